"""Decode tokens/s of unconstrained requests (off, lookup adaptive), embedded model: prints one JSON line."""
import json, os, sys, time
import gemma_spec_ros
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.types import EngineConfig, ModelConfig, GenerationRequest, SpecConfig
PROMPTS = ["The three laws of robotics are", "def moving_average(values, window):\n", "Task: pick up the red cup and put it in the sink.\nSteps:\n1.",
           '{"robots": [{"name": "atlas", "battery": 0.82},']
eng = Engine(EngineConfig(target=ModelConfig(path=os.path.expanduser("~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf"), n_ctx=1024), spec=SpecConfig(mode="off", draft_max=4)))
out = {"src": os.path.dirname(gemma_spec_ros.__file__)}
for mode in ("off", "lookup"):
    toks = t = 0.0
    for p in PROMPTS:
        last = None
        for st in eng.generate(GenerationRequest(p, max_tokens=128, spec_mode=mode, reuse_prompt=False)): last = st
        toks += last.stats.num_step_tokens; t += last.stats.generation_time
    out[mode] = toks / t
eng.close()
print(json.dumps(out))
