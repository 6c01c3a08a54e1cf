"""hpcgrad.training.safetensors (issue 27) against the safetensors package and PyTorch."""

import json
import struct

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad import checkpoint
from hpcgrad.utils import safetensors as hst

DTYPES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
          "uint8", "bool"]


def _torch_tensors(torch):
    g = torch.Generator().manual_seed(0)
    out = {}
    for name in DTYPES:
        dtype = getattr(torch, name)
        values = torch.randn(2, 3, generator=g) * 50
        out[f"t.{name}"] = values > 0 if name == "bool" else values.to(dtype)
    out["scalar"] = torch.tensor(1.5)
    out["empty"] = torch.zeros(0, 4)
    return out


def test_bytes_match_the_safetensors_package():
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    theirs = _torch_tensors(torch)
    ours = {name: hg.Tensor(t.float().numpy().astype(hst._dtype(_code(t), name, "test"))
                            if t.dtype == torch.bfloat16 else t.numpy())
            for name, t in theirs.items()}
    metadata = {"note": "é"}  # one key: the package writes a hash map's order
    assert hst.save(ours, metadata) == st.save(theirs, metadata)


def _code(t):
    return "BF16" if str(t.dtype) == "torch.bfloat16" else None


def test_torch_weights_load_with_names_dtypes_and_values(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    theirs = _torch_tensors(torch)
    path = tmp_path / "w.safetensors"
    st.save_file(theirs, str(path))
    for ours in (hst.load_file(path), hst.load(path.read_bytes()), hg.load(path)):
        assert sorted(ours) == sorted(theirs)
        for name, t in theirs.items():
            got = ours[name]
            assert type(got) is hg.Tensor and got.shape == tuple(t.shape)
            assert got.dtype.name == str(t.dtype).removeprefix("torch."), name
            np.testing.assert_array_equal(got.array.astype(np.float64),
                                          t.double().numpy() if t.dtype != torch.bool
                                          else t.numpy())
            assert got.array.flags.writeable and got.array.flags.c_contiguous
    loaded = hst.load_file(path)  # each owns its memory: it saves again as it came
    assert hst.save(loaded) == st.save(theirs)


def test_our_model_loads_in_pytorch_with_identical_outputs(tmp_path):
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    hg.manual_seed(1)
    ours = hg.nn.Sequential(hg.nn.Linear(3, 4), hg.nn.ReLU(), hg.nn.Linear(4, 2))
    path = tmp_path / "model.safetensors"
    hst.save_file(ours.state_dict(), path, metadata={"format": "pt"})
    theirs = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    theirs.load_state_dict(st.load_file(str(path)))
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_allclose(theirs(torch.from_numpy(x)).detach().numpy(),
                               ours(hg.tensor(x)).array, rtol=1e-5, atol=1e-6)
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_refuses_what_safetensors_refuses():
    base = hg.tensor(np.arange(12, dtype=np.float32).reshape(3, 4))
    with pytest.raises(ValueError, match="You are trying to save a non contiguous tensor: `t`"):
        hst.save({"t": base.t()})
    with pytest.raises(RuntimeError, match=r"Some tensors share memory.*\[\['a', 'b'\]\]"):
        hst.save({"a": base, "b": base[1:]})
    with pytest.raises(ValueError, match="Expected a dict of \\[str, torch.Tensor\\]"):
        hst.save([base])
    with pytest.raises(ValueError, match="Key `n` is invalid, expected torch.Tensor"):
        hst.save({"n": 3})
    with pytest.raises(ValueError, match="dtype complex128"):
        hst.save({"c": hg.Tensor(np.ones(2, np.complex128))})
    with pytest.raises(TypeError, match="metadata must be a dict of str to str"):
        hst.save({"a": base}, metadata={"epoch": 3})


def _file(header, data=b""):
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


def test_malformed_files_say_what_was_expected(tmp_path):
    path = tmp_path / "bad.safetensors"
    good = hst.save({"w": hg.ones(4)})
    path.write_bytes(good[:-3])
    with pytest.raises(hst.SafetensorError, match=r"bad.safetensors.* is truncated: tensor "
                                                  r"'w' needs bytes 0..16.*has 13"):
        hst.load_file(path)
    path.write_bytes(good[:20])
    with pytest.raises(hst.SafetensorError, match="truncated: the header says"):
        hg.load(path)
    path.write_bytes(b"abc")
    with pytest.raises(hst.SafetensorError, match="starts with an 8-byte header length"):
        hst.load_file(path)
    unknown = _file({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, b"ab")
    with pytest.raises(hst.SafetensorError, match="'w' has dtype 'F8_E4M3'"):
        hst.load(unknown)
    wrong = _file({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"abcd")
    with pytest.raises(hst.SafetensorError, match="needs 8 bytes, its offsets give 4"):
        hst.load(wrong)


def test_save_file_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "w.safetensors"
    hst.save_file({"w": hg.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(ValueError):
        hst.save_file({"w": hg.ones((2, 2)).t()}, path)

    def killed(phase, **where):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(checkpoint, "_reached", killed)
    with pytest.raises(KeyboardInterrupt):
        hst.save_file({"w": hg.zeros(2)}, path)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.skipif(hg.cuda.is_available(), reason="the error is for machines without a GPU")
def test_load_file_to_cuda_without_a_gpu(tmp_path):
    hst.save_file({"w": hg.ones(2)}, tmp_path / "w.safetensors")
    with pytest.raises(RuntimeError, match="no CUDA device is available.*device='cpu'"):
        hst.load_file(tmp_path / "w.safetensors", device="cuda")
