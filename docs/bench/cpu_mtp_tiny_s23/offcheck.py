"""off / lookup / draft on the embedded model: ms per target pass (generation_time / steps), median of 3."""
import os, statistics, json
from gemma_spec_ros.engine.engine import Engine
from gemma_spec_ros.engine.types import EngineConfig, GenerationRequest, ModelConfig, SpecConfig
M = os.path.expanduser("~/.cache/gemma_spec_ros/models/gemma-3-270m-q4_k_m.gguf")
eng = Engine(EngineConfig(target=ModelConfig(M, n_ctx=512, n_threads=1),
    draft=ModelConfig(M, n_ctx=512, n_threads=1), spec=SpecConfig(mode="off", draft_max=3, adaptive=False)))
prompt = "The lighthouse keeper had not seen a ship in eleven days when the bell on the rocks began to ring. "
out = {}
for mode in ("off", "lookup", "draft"):
    xs = []
    for _ in range(3):
        s = list(eng.generate(GenerationRequest(prompt, max_tokens=96, spec_mode=mode)))[-1].stats
        xs.append(s.generation_time / s.num_steps * 1e3)
    out[mode] = statistics.median(xs)
eng.close()
print(json.dumps(out))
