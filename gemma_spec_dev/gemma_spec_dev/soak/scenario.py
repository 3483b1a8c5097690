"""What the soak sends: the goals (valid ones of every kind, and the invalid ones the node must
refuse), where a goal is cancelled, the parameter values it sets, and when the lifecycle cycles
come. Pure data and seeded draws: the same seed gives the same run."""
from __future__ import annotations

import random
from typing import Any, Callable, Dict, List, Sequence, Tuple

#: Cancel points of a cancelled goal: in the goal-response callback, right after acceptance (queued
#: or in prompt evaluation), mid-stream after k feedback messages, or after a random delay.
CANCEL_POINTS = ("response", "accepted", "stream", "delay")
COMPLETION_PROMPTS = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n",
    "The robot moved to the kitchen. The robot picked up the cup. The robot",
    "Step 1: open the gripper.\nStep 2: move to the shelf.\nStep 3:",
    "List of rooms: kitchen, hallway, office, lab, kitchen, hallway,",
)
#: The goal whose greedy output must be the same at the end of the run as at the start.
GOLDEN = dict(prompt="def mul(a, b):\n    return a * b\n\ndef div(a, b):\n", max_tokens=24,
              temperature=0.0, seed=1, spec_mode="off")
#: The share of parameter sets that use an invalid value (which the node must refuse).
INVALID_PARAMETER_SHARE = 0.2

#: (parameter name, a draw of its value) for the parameter thread.
ParameterDraws = List[Tuple[str, Callable[[], Any]]]


def invalid_goals(limits: Dict[str, int]) -> List[Tuple[str, Dict[str, Any]]]:
    """(kind, goal fields) of goals the node must reject, whatever its runtime parameters."""
    nan = float("nan")
    return [
        ("empty prompt", dict(prompt="")),
        ("temperature nan", dict(prompt="hi", temperature=nan)),
        ("temperature negative", dict(prompt="hi", temperature=-2.0)),
        ("top_p > 1", dict(prompt="hi", top_p=1.5)),
        ("top_k < -1", dict(prompt="hi", top_k=-5)),
        ("unknown spec_mode", dict(prompt="hi", spec_mode="warp" * 50)),
        ("seed < -1", dict(prompt="hi", seed=-7)),
        ("time_budget negative", dict(prompt="hi", time_budget=-1.0)),
        ("max_tokens over the limit", dict(prompt="hi", max_tokens=limits["max_tokens"] + 1)),
        ("empty stop string", dict(prompt="hi", stop=["ok", ""])),
        ("too many stop strings", dict(prompt="hi", stop=[f"s{i}" for i in range(limits["max_stop_strings"] + 1)])),
        ("stop string too long", dict(prompt="hi", stop=["x" * (limits["max_stop_length"] + 1)])),
        ("prompt over max_prompt_bytes", dict(prompt="é" * (limits["max_prompt_bytes"] // 2 + 1))),
        # over the limit even on the remote backend's lower-bound estimate (16 bytes per token)
        ("prompt over max_prompt_tokens",
         dict(prompt=" ".join(f"w{i}" for i in range(min(17 * limits["max_prompt_tokens"] // 4,
                                                          limits["max_prompt_bytes"] // 6))))),
        ("draft mode without a draft model", dict(prompt="hi", spec_mode="draft")),
    ]


def valid_goal(rng: random.Random, limits: Dict[str, int], max_tokens: int) -> Tuple[str, Dict[str, Any]]:
    """(kind, goal fields) of a goal the node must accept when active with room in its queue."""
    prompt = rng.choice(COMPLETION_PROMPTS)
    tokens = rng.randint(1, max_tokens)
    roll = rng.random()
    if roll < 0.35:
        return "greedy", dict(prompt=prompt, max_tokens=tokens, temperature=0.0, seed=1)
    if roll < 0.55:
        return "sampled", dict(prompt=prompt, max_tokens=tokens, temperature=0.8, top_p=0.95,
                               seed=rng.randint(0, 1 << 30))
    if roll < 0.65:
        return "chat", dict(prompt="Name a room.", system_prompt=rng.choice(["", "Be brief."]),
                            use_chat_template=True, max_tokens=tokens, temperature=0.0)
    if roll < 0.8:
        stops = rng.sample(["\n", "def", "The", ",", "Step", ")"], rng.randint(1, 4))
        return "stop list", dict(prompt=prompt, max_tokens=tokens, temperature=0.0, stop=stops)
    if roll < 0.9:
        words = max(8, int(limits["max_prompt_tokens"] * 0.4))
        return "long prompt", dict(prompt=" ".join(["kitchen hallway"] * (words // 2)), max_tokens=tokens,
                                   temperature=0.0)
    return "priority", dict(prompt=prompt, max_tokens=tokens, temperature=0.0,
                            priority=rng.randint(0, 3), preempt=rng.random() < 0.3)


def parameter_draws(rng: random.Random) -> Tuple[ParameterDraws, ParameterDraws]:
    """(valid, invalid): runtime parameters with draws of values the node must accept, and of
    values it must refuse with a reason."""
    valid = [("spec.mode", lambda: rng.choice(["off", "lookup", "auto"])),
             ("spec.draft_max", lambda: rng.choice([1, 2, 4, 8, 16])),
             ("spec.adaptive", lambda: rng.random() < 0.5),
             ("spec.verification", lambda: rng.choice(["exact", "rejection"])),
             ("feedback.min_period", lambda: rng.choice([0.0, 0.1])),
             ("queue.max_depth", lambda: rng.choice([2, 4, 8]))]
    invalid = [("spec.mode", lambda: "hyperdrive"), ("spec.draft_max", lambda: 999),
               ("spec.verification", lambda: "maybe"), ("spec.mode", lambda: "draft"),
               ("generation.max_tokens", lambda: 10 ** 7),
               ("target.n_ctx", lambda: 4096)]  # configure-time: refused while configured
    return valid, invalid


def cycle_plan(rng: random.Random, cycles: Sequence[str], goals: int) -> List[Tuple[int, str]]:
    """(goal index, cycle) pairs in index order, at random indices below ``goals``. With fewer goals
    than cycles some are left out, never the remote phase (the clients keep sending until it ran).

    >>> cycle_plan(random.Random(0), ["deactivate", "cleanup", "remote"], 2)
    [(1, 'remote')]
    """
    marks = sorted(rng.sample(range(1, max(2, goals)), min(len(cycles), max(1, goals - 1))))
    labels = rng.sample(list(cycles), len(cycles))[:len(marks)]
    if "remote" in cycles and "remote" not in labels:
        labels[-1] = "remote"
    return list(zip(marks, labels))
