"""The streaming reader under ``load_checkpoint``: bit-identical tensors, bounded staging memory (counted), file-order
reads, an EP rank reading only its experts' bytes, progress lines, and the loader's validation still in front."""

from __future__ import annotations

import io
import re

import pytest
import torch
from safetensors.torch import load_file

from minidi.runtime.build import rank_experts_only
from minidi.runtime.checkpoint import CheckpointError, load_checkpoint, tiny_checkpoint
from minidi.runtime.stream_load import TensorReader, read_header


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("tiny-v41")


@pytest.fixture(scope="module")
def reference(ckpt):
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("staging", [False, True])
def test_stream_is_bit_identical_and_bounded(ckpt, reference, staging):
    chunk = 4096  # smaller than most tiny tensors: every large one crosses several chunks
    reader = TensorReader("cpu", chunk_bytes=chunk, staging=staging, progress=False)
    cfg, tensors = load_checkpoint(ckpt, reader=reader)
    assert set(tensors) == set(reference) and len(tensors) == reader.tensors_read
    for n, t in tensors.items():
        assert t.dtype == reference[n].dtype and t.shape == reference[n].shape, n
        assert torch.equal(_bits(t), _bits(reference[n])), n
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    assert reader.bytes_read == total  # each tensor's bytes read exactly once
    # host staging: two chunks at most, however large the checkpoint (0 when reading straight into CPU tensors)
    assert reader.peak_staging_bytes == (2 * chunk if staging else 0) < total / 100


def test_reads_follow_file_order(ckpt):
    reader = TensorReader("cpu", progress=False)
    load_checkpoint(ckpt, reader=reader)
    offsets = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        with open(f, "rb") as fh:
            header, _ = read_header(fh)
        offsets.update({n: (f.name, e["data_offsets"][0]) for n, e in header.items()})
    seq = [offsets[n] for n in reader.read_order]
    for (fa, oa), (fb, ob) in zip(seq, seq[1:]):
        assert fa != fb or oa < ob  # within a shard, increasing offsets: sequential reads


def test_rank_reads_only_its_experts(ckpt, reference):
    cfg, _ = load_checkpoint(ckpt, reader=TensorReader(progress=False))
    rank = cfg.with_(ep_size=2, ep_rank=1)
    reader = TensorReader("cpu", progress=False)
    _, tensors = load_checkpoint(ckpt, cfg=rank, only=rank_experts_only(rank), reader=reader)
    assert not any(".experts.0." in n or ".experts.3." in n for n in reader.read_order)
    want = sum(t.numel() * t.element_size() for n, t in reference.items() if rank_experts_only(rank)(n))
    assert reader.bytes_read == want < sum(t.numel() * t.element_size() for t in reference.values())
    assert set(tensors) == set(reader.read_order)


def test_progress_lines(ckpt):
    out = io.StringIO()
    reader = TensorReader("cpu", chunk_bytes=1 << 16, staging=True, progress=True, progress_after_s=0.0,
                          progress_every_s=0.0, stream=out)
    load_checkpoint(ckpt, reader=reader)
    lines = out.getvalue().splitlines()
    assert len(lines) > 2 and lines[-1].startswith("loading checkpoint [") and "(100%)" in lines[-1]
    assert "GB/s" in lines[-1]
    quiet = io.StringIO()  # the default: nothing for a load that takes less than a few seconds
    load_checkpoint(ckpt, reader=TensorReader(stream=quiet))
    assert quiet.getvalue() == ""


def test_validation_still_first(ckpt, tmp_path):
    """A misshaped tensor is reported by the loader's validation and never read."""
    import shutil

    from safetensors.torch import save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    shard = next(iter(sorted(bad.glob("*.safetensors"))))
    tensors = load_file(str(shard))
    name = next(n for n, t in tensors.items() if t.dim() == 2)
    tensors[name] = tensors[name][:1].clone()
    save_file(tensors, str(shard))
    reader = TensorReader(progress=False)
    with pytest.raises(CheckpointError, match=rf"misshaped tensors .*{re.escape(name)}"):
        load_checkpoint(bad, reader=reader)
    assert name not in reader.read_order


def test_reader_rejects_bad_chunk():
    with pytest.raises(ValueError, match="chunk_bytes"):
        TensorReader(chunk_bytes=0)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [4096, 64 << 20])
def test_cuda_stream_matches_cpu(ckpt, reference, chunk):
    """The device path: pinned double buffer, async copies; bit-identical to the file, staging bounded."""
    reader = TensorReader("cuda", chunk_bytes=chunk, progress=False)
    _, tensors = load_checkpoint(ckpt, device="cuda", reader=reader)
    assert reader.peak_staging_bytes == 2 * chunk
    for n, t in tensors.items():
        assert t.is_cuda and torch.equal(_bits(t.cpu()), _bits(reference[n])), n


@pytest.mark.gpu
def test_load_model_cuda_streams(ckpt):
    import minidi

    gpu = minidi.load_model("tiny-v41", device="cuda", dtype="float32", fake_quant=False)
    cpu = minidi.load_model("tiny-v41", dtype="float32", fake_quant=False)
    assert gpu.tokenizer is not None and gpu.engram_token_map.is_cuda
    for (n, a), (_, b) in zip(gpu.state_dict().items(), cpu.state_dict().items()):
        assert torch.equal(_bits(a.cpu()), _bits(b)), n
