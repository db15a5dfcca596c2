"""Pass match counts on the real model graph without running Inductor (trace only): quick check on a torch stack.

    PYTHONPATH=. python bench/debug/trace_counts.py tiny-v41 [ep]
"""
import sys, torch
import minidi
from minidi.model.context import ModelCache, StepMeta
from minidi.passes import expected_sites
from minidi.runtime.engine import dynamic_shape_config

dev = "cuda" if torch.cuda.is_available() else "cpu"
name = sys.argv[1] if len(sys.argv) > 1 else "tiny-v41"
ep = int(sys.argv[2]) if len(sys.argv) > 2 else 1
model = minidi.load_model(name, device=dev, ep_size=ep)
if ep > 1:
    from minidi.runtime.expert_parallel import EmulatedEP
    model.set_expert_exchange(EmulatedEP(ep))
step = minidi.compile(model, "all", backend=lambda gm, inputs: gm.forward, strict=False, regional=True)
cfg = model.cfg
ids = torch.randint(0, cfg.vocab_size, (40,), device=dev)
meta = StepMeta.for_sequence(ids, cfg.window_size, model.ratios, cfg.engram_max_ngram if cfg.engram_layers else 0)
with torch.no_grad(), dynamic_shape_config():
    step(meta, ModelCache())
want = {k: len(v) for k, v in expected_sites(cfg, regional=True).items()}
print(torch.__version__, name, "ep", ep, "counts", step.counts, "expected", want, "OK" if step.counts == want else "MISMATCH")
