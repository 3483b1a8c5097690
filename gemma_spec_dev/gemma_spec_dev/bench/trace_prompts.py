"""The requests of the multi-request traces (:mod:`.trace`), in the order a client sends them.

- ``planner``: a robot task planner's day: the planner suite's system prompt (prompts/planner.yaml:
  the robot, its places, skills, safety rules and plan schema) with one instruction after another.
  The instructions are new text; the plans reuse the skills, places and argument patterns of the
  plans before them, which is what a history of earlier outputs can draft from.
- ``agent``: an agent loop over one source file: every turn shows the file as the earlier turns
  left it and asks for it again with one more edit, so each answer is mostly the file once more.
"""
from __future__ import annotations

from typing import List, Tuple

#: Instructions to the planner, one request each (36: medians are taken after the first five).
PLANNER_INSTRUCTIONS: Tuple[str, ...] = (
    "Bring the red cup from the kitchen table to the dishwasher.",
    "The milk was left on the counter; put it away.",
    "Wipe the kitchen table, then tell me when you are done.",
    "Put the knife from the table into the cutlery drawer.",
    "Take the empty bottle from the living room table to the recycling bin.",
    "Bring me a towel from the towel drawer; I am on the sofa.",
    "Put the book from the sofa back on the bookshelf.",
    "Close the fridge door, somebody left it open.",
    "Throw the banana peel on the kitchen counter into the trash bin.",
    "Bring the blue mug from the window sill to the sink.",
    "Put the bread from the kitchen table into the pantry.",
    "Check whether the oven is on and tell me.",
    "Move the plant from the kitchen table to the window sill.",
    "Put the clean plates from the dishwasher into the upper left cupboard.",
    "Start the dishwasher.",
    "Bring the remote control from the bookshelf to the living room table.",
    "Pour 150 ml of juice from the bottle on the counter into the glass on the table.",
    "Put the butter back where it belongs.",
    "Clear the living room table: the cups go to the dishwasher, the papers to the recycling bin.",
    "Go to the front door and say that dinner is ready.",
    "Put the spoon from the sink into the dishwasher.",
    "Ask the person on the sofa whether they want tea or coffee.",
    "Wipe the kitchen counter next to the stove.",
    "Bring the apple from the fridge to the person on the sofa.",
    "Put the cereal box from the kitchen table into the pantry.",
    "Open the upper right cupboard and look for the salt.",
    "Take the towel from the kitchen counter back to the towel drawer.",
    "Bring the glass from the living room table to the sink.",
    "Put the yogurt from the kitchen table back into the fridge.",
    "Wait two minutes, then bring the tea cup from the counter to the sofa.",
    "Take the empty cans from the counter to the recycling bin.",
    "Move the chair out of the hallway and tell me when the way is clear.",
    "Put the fork and the knife from the table into the cutlery drawer.",
    "Bring the newspaper from the front door to the living room table.",
    "Your battery is at 19 %. Finish what you are doing and go charge.",
    "Put the jam jar from the kitchen table back into the fridge.",
)

#: The file the agent loop edits: a robot's battery monitor, small enough for a 2k-token context.
AGENT_FILE = '''"""Battery monitor of a mobile robot: reads the voltage and says when to dock."""
import time

LOW_VOLTAGE = 22.0
CRITICAL_VOLTAGE = 21.0


class BatteryMonitor:
    def __init__(self, sensor, period=1.0):
        self.sensor = sensor
        self.period = period
        self.history = []

    def read(self):
        voltage = self.sensor.voltage()
        self.history.append(voltage)
        if len(self.history) > 100:
            self.history.pop(0)
        return voltage

    def average(self):
        if not self.history:
            return 0.0
        return sum(self.history) / len(self.history)

    def state(self):
        voltage = self.average()
        if voltage < CRITICAL_VOLTAGE:
            return "critical"
        if voltage < LOW_VOLTAGE:
            return "low"
        return "ok"

    def run(self, on_low):
        while True:
            self.read()
            if self.state() != "ok":
                on_low(self.state())
            time.sleep(self.period)
'''

#: One edit per turn: (what the turn asks, the text it replaces, its replacement). Each turn's
#: prompt shows the file with the edits of the turns before it applied.
AGENT_EDITS: Tuple[Tuple[str, str, str], ...] = (
    ("Rename the method read to sample.", "def read(self)", "def sample(self)"),
    ("Keep 200 readings instead of 100.", "> 100:", "> 200:"),
    ("Rename the attribute history to readings.", "self.history", "self.readings"),
    ("Raise LOW_VOLTAGE to 22.5.", "LOW_VOLTAGE = 22.0", "LOW_VOLTAGE = 22.5"),
    ("Give the constructor a default period of 0.5 seconds.", "period=1.0", "period=0.5"),
    ("Return None from average when there are no readings.", "return 0.0", "return None"),
    ("Rename the callback on_low to on_alarm.", "on_low", "on_alarm"),
    ("Rename the method state to level.", "def state(self)", "def level(self)"),
    ("Call the renamed method level in run.", "self.state()", "self.level()"),
    ("Rename the state ok to normal.", '"ok"', '"normal"'),
    ("Lower CRITICAL_VOLTAGE to 20.5.", "CRITICAL_VOLTAGE = 21.0", "CRITICAL_VOLTAGE = 20.5"),
    ("Rename the class BatteryMonitor to PowerMonitor.", "class BatteryMonitor", "class PowerMonitor"),
    ("Import time as clock.", "import time", "import time as clock"),
    ("Call clock.sleep in run.", "time.sleep", "clock.sleep"),
    ("Rename the argument sensor to probe.", "sensor", "probe"),
    ("Rename the method average to mean.", "def average(self)", "def mean(self)"),
)


def agent_turns() -> List[Tuple[str, str]]:
    """(request id, prompt) of every turn of the agent loop, in order."""
    turns = []
    text = AGENT_FILE
    for number, (ask, old, new) in enumerate(AGENT_EDITS, start=1):
        prompt = (f"Here is robot/battery.py:\n\n```python\n{text}```\n\n{ask} "
                  "Here is the whole file with that change:\n\n```python\n")
        turns.append((f"turn-{number:02d}", prompt))
        text = text.replace(old, new)
    return turns
