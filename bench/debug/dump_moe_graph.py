"""Dump the Dynamo FX graph of one tiny layer around torch._grouped_mm (pass D debugging across torch versions)."""
import os, sys, torch
import minidi
from minidi.model.context import ModelCache, StepMeta
from minidi.runtime.engine import dynamic_shape_config

dev = "cuda" if torch.cuda.is_available() else "cpu"
out = sys.argv[1] if len(sys.argv) > 1 else "moe_graph.txt"
model = minidi.load_model("tiny-v41", device=dev, ep_size=int(os.environ.get("EP", "1")))
lines = []

def backend(gm, inputs):
    for n in gm.graph.nodes:
        v = n.meta.get("example_value")
        lines.append(f"{n.format_node()}    # {getattr(v, 'dtype', '')} {tuple(getattr(v, 'shape', ()))}")
    return gm.forward

blk = model.layers[0]
blk.compile(backend=backend, fullgraph=True, dynamic=True)
ids = torch.randint(0, model.cfg.vocab_size, (40,), device=dev)
meta = StepMeta.for_sequence(ids, model.cfg.window_size, model.ratios, model.cfg.engram_max_ngram)
with torch.no_grad(), dynamic_shape_config():
    model.step(meta, ModelCache())
open(out, "w").write(torch.__version__ + "\n" + "\n".join(lines))
print("wrote", out, len(lines))
