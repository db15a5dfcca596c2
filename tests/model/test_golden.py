"""Golden logits and greedy tokens of the embedded tiny checkpoints, pinned with expecttest.

Refresh deliberately with `EXPECTTEST_ACCEPT=1 pytest tests/model/test_golden.py` and say why in the commit: any
change here means the model's numerics changed.
"""

import expecttest
import torch

import minidi

PROMPT = [0, 17, 93, 240, 5, 311, 77, 402, 128, 9, 66, 250, 33, 480, 2, 101, 199, 7, 364, 45, 18, 290, 150, 3]


def _greedy(model, prompt, n):
    ids = torch.tensor(prompt)
    out = []
    for _ in range(n):  # full recompute per token (the runtime's cache makes this incremental)
        nxt = int(model(ids)[-1].argmax())
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([nxt])])
    return out


def _summary(logits):
    last = logits[-1]
    return (f"argmax per position {logits.argmax(-1).tolist()}\n"
            f"last[:6] {[round(v, 2) for v in last[:6].tolist()]} mean|.| {last.abs().mean():.3f}")


class TestGolden(expecttest.TestCase):
    def test_tiny_v41_logits_and_greedy(self):
        model = minidi.load_model("tiny-v41")
        self.assertExpectedInline(_summary(model(torch.tensor(PROMPT))), """\
argmax per position [9, 231, 392, 408, 315, 95, 408, 76, 117, 215, 458, 128, 316, 239, 21, 76, 500, 432, 440, 158, 309, 332, 87, 51]
last[:6] [0.39, -0.49, -0.75, -0.95, 0.5, -0.77] mean|.| 0.814""")
        self.assertExpectedInline(str(_greedy(model, PROMPT, 8)), """[51, 503, 510, 134, 128, 197, 251, 173]""")

    def test_tiny_v4_greedy(self):
        model = minidi.load_model("tiny-v4")
        self.assertExpectedInline(str(_greedy(model, PROMPT, 8)), """[198, 56, 177, 177, 10, 241, 81, 139]""")
