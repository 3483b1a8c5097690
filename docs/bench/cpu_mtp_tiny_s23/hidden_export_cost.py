"""4-row target decode cost with hidden-row export on vs off, at several positions (tiny gemma4)."""
import statistics, sys, time
from gemma_spec_ros.engine.backend import LlamaBackend
from gemma_spec_ros.engine.mtp import TargetHiddenRows
from gemma_spec_ros.engine.types import ModelConfig
T = "/tmp/mtpspeed/tiny-gemma4-agreeing.gguf"
t = LlamaBackend(ModelConfig(T, n_ctx=512, n_threads=1, flash_attn=True))
hid = TargetHiddenRows(t)
toks = [3 + (i * 37) % 200 for i in range(400)]
res = {}
for pos in (50, 150, 300):
    for rows in (1, 4):
        for on in (False, True, False, True):
            hid.enable(on)
            t.clear(); t.decode(toks[:pos], [])
            ts = []
            for _ in range(200):
                _, s = t.timed_decode(toks[pos:pos + rows], range(rows))
                t.rollback(pos); ts.append(s * 1e3)
            res.setdefault((pos, rows, on), []).append(statistics.median(ts))
for k, v in sorted(res.items()):
    print(k, " ".join(f"{x:.3f}" for x in v))
