"""hpcgrad.save / hpcgrad.load (issue 27): round trips, PyTorch's files, weights_only, atomicity."""

import io
import os
import pickle
import sys
from collections import OrderedDict

import numpy as np
import pytest

import hpcgrad as hg
from hpcgrad import checkpoint

RAN = []  # what a malicious file's reconstructor did: must stay empty under weights_only


def _side_effect(tag):
    RAN.append(tag)
    return tag


class Evil:
    """Pickles as a call of _side_effect: loading it runs code."""

    def __reduce__(self):
        return _side_effect, ("evil ran",)


def _model():
    hg.manual_seed(0)
    return hg.nn.Sequential(hg.nn.Linear(3, 4), hg.nn.ReLU(), hg.nn.Linear(4, 2))


def test_state_dict_round_trip_through_a_path_and_a_file_object(tmp_path):
    model = _model()
    sd = model.state_dict()
    path = tmp_path / "model.pt"
    hg.save(sd, path)
    buffer = io.BytesIO()
    hg.save(sd, buffer)
    buffer.seek(0)
    for back in (hg.load(path), hg.load(str(path)), hg.load(buffer)):
        assert type(back) is OrderedDict and list(back) == list(sd)
        for name, t in sd.items():
            assert type(back[name]) is hg.Tensor and back[name].dtype == t.dtype
            np.testing.assert_array_equal(back[name].array, t.array)
    other = _model()
    other[0].weight.array[...] = 0
    other.load_state_dict(hg.load(path))
    x = hg.randn(5, 3)
    np.testing.assert_array_equal(other(x).array, model(x).array)


def test_nested_plain_values_round_trip(tmp_path):
    obj = {"n": 3, "big": 2 ** 70, "f": 1.5, "nan": float("nan"), "s": "x", "none": None,
           "b": True, "t": (1, [2.0, "a"]), "set": {1, 2}, "fs": frozenset({3}),
           "bytes": b"\x00\xff", "ba": bytearray(b"ab"), "c": 1 + 2j, 7: "int key",
           (1, 2): "tuple key", "arr": np.arange(6).reshape(2, 3).T, "np": np.float32(2.5),
           "dtype": np.dtype(np.int16), "dev": hg.device("cpu")}
    hg.save(obj, tmp_path / "x.pt")
    back = hg.load(tmp_path / "x.pt")
    assert list(back) == list(obj)
    for key, value in obj.items():
        if key == "nan":
            assert np.isnan(back[key])
        elif key == "arr":
            np.testing.assert_array_equal(back[key], value)
        else:
            assert back[key] == value and type(back[key]) is type(value), key
    assert type(back["dev"]) is hg.device


def test_tensors_keep_requires_grad_parameter_class_and_identity(tmp_path):
    p = hg.nn.Parameter(hg.ones(2))
    frozen = hg.nn.Parameter(hg.zeros(2), requires_grad=False)
    t = hg.tensor([1.0, 2.0], requires_grad=True)
    hg.save({"p": p, "frozen": frozen, "t": t, "again": t, "ints": hg.tensor([1, 2])},
            tmp_path / "x.pt")
    back = hg.load(tmp_path / "x.pt")
    assert type(back["p"]) is hg.nn.Parameter and back["p"].requires_grad
    assert type(back["frozen"]) is hg.nn.Parameter and not back["frozen"].requires_grad
    assert type(back["t"]) is hg.Tensor and back["t"].requires_grad and back["t"].is_leaf
    assert back["again"] is back["t"]  # one tensor saved twice loads as one, as pickle's memo
    assert back["ints"].dtype == np.int64 and not back["ints"].requires_grad


def test_bfloat16_round_trips(tmp_path):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    t = hg.Tensor(np.array([1.5, -2.0], ml_dtypes.bfloat16))
    hg.save({"t": t, "dtype": t.dtype}, tmp_path / "x.pt")  # .npy keeps only its bytes (V2)
    back = hg.load(tmp_path / "x.pt")
    assert back["t"].dtype == t.dtype and back["dtype"] == t.dtype
    assert back["t"].array.astype(np.float32).tolist() == [1.5, -2.0]


def test_optimizer_state_dict_round_trip_resumes_identically(tmp_path):
    def steps(model, opt, n):
        for i in range(n):
            opt.zero_grad()
            model(hg.tensor(np.full((2, 3), i + 1.0, np.float32))).sum().backward()
            opt.step()

    model = _model()
    opt = hg.optim.Adam(model.parameters(), lr=0.01)
    steps(model, opt, 2)
    hg.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": 2},
            tmp_path / "ckpt.pt")
    steps(model, opt, 2)
    resumed = _model()
    ropt = hg.optim.Adam(resumed.parameters(), lr=0.5)
    ckpt = hg.load(tmp_path / "ckpt.pt")
    resumed.load_state_dict(ckpt["model"])
    ropt.load_state_dict(ckpt["opt"])
    assert ckpt["epoch"] == 2 and ropt.param_groups[0]["betas"] == (0.9, 0.999)
    steps(resumed, ropt, 2)
    for a, b in zip(model.parameters(), resumed.parameters()):
        np.testing.assert_array_equal(a.array, b.array)


def test_torch_saved_state_dict_loads_without_torch_types(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    theirs = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    path = tmp_path / "torch.pt"
    tied = torch.arange(6.0).reshape(2, 3)
    torch.save({"sd": theirs.state_dict(), "param": torch.nn.Parameter(torch.ones(2)),
                "tied": tied, "tied_t": tied.t(), "half": torch.ones(2, dtype=torch.float16),
                "long": torch.arange(3), "set": {1}, "bytes": b"ab", "dtype": torch.float64,
                "size": torch.Size([2, 3]), "device": torch.device("cpu")}, path)
    # Any import of torch while loading fails: hpcgrad must rebuild everything itself.
    for name in [n for n in sys.modules if n == "torch" or n.startswith("torch.")]:
        monkeypatch.setitem(sys.modules, name, None)
    back = hg.load(path)
    monkeypatch.undo()
    sd = theirs.state_dict()
    assert type(back["sd"]) is OrderedDict and list(back["sd"]) == list(sd)
    for name, t in sd.items():
        assert back["sd"][name].dtype == np.float32
        np.testing.assert_array_equal(back["sd"][name].array, t.numpy())
    assert type(back["param"]) is hg.nn.Parameter and back["param"].requires_grad
    np.testing.assert_array_equal(back["tied_t"].array, tied.t().numpy())
    assert np.shares_memory(back["tied"].array, back["tied_t"].array)  # one storage, as torch
    assert back["half"].dtype == np.float16 and back["long"].array.tolist() == [0, 1, 2]
    assert back["set"] == {1} and back["bytes"] == b"ab" and back["dtype"] == np.float64
    assert back["size"] == (2, 3) and back["device"] == "cpu"
    ours = _model()
    ours.load_state_dict(back["sd"])
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    np.testing.assert_allclose(ours(hg.tensor(x)).array,
                               theirs(torch.from_numpy(x)).detach().numpy(), rtol=1e-5, atol=1e-6)


def test_weights_only_refuses_a_custom_class_without_running_it(tmp_path):
    RAN.clear()
    hg.save({"w": hg.ones(2), "evil": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed") as info:
        hg.load(tmp_path / "evil.pt")
    assert "weights_only=False" in str(info.value) and "Evil" in str(info.value)
    assert RAN == []
    assert hg.load(tmp_path / "evil.pt", weights_only=False)["evil"] == "evil ran"
    assert RAN == ["evil ran"]  # the side effect is observable: the refusal above is real


def test_weights_only_refuses_a_torch_file_with_a_custom_global(tmp_path):
    torch = pytest.importorskip("torch")
    RAN.clear()
    torch.save({"w": torch.ones(2), "evil": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed") as info:
        hg.load(tmp_path / "evil.pt")
    assert "_side_effect" in str(info.value) and "weights_only=False" in str(info.value)
    assert RAN == []
    back = hg.load(tmp_path / "evil.pt", weights_only=False)
    assert back["evil"] == "evil ran" and RAN == ["evil ran"]
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")  # a whole module, not weights
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        hg.load(tmp_path / "module.pt")
    with pytest.raises(pickle.UnpicklingError, match="torch.nn.modules.linear.Linear, a PyTorch "
                                                     "type that hpcgrad does not rebuild"):
        hg.load(tmp_path / "module.pt", weights_only=False)


def test_map_location_forms(tmp_path):
    t = hg.tensor([1.0, 2.0])
    hg.save({"t": t}, tmp_path / "x.pt")
    seen = []

    def keep(storage, location):
        seen.append(location)
        return storage

    for where in (None, "cpu", hg.device("cpu"), {"cuda:0": "cpu"}, keep,
                  lambda storage, location: None):
        back = hg.load(tmp_path / "x.pt", map_location=where)["t"]
        assert back.device == "cpu" and back.array.tolist() == [1.0, 2.0]
    assert seen == ["cpu"]
    with pytest.raises(TypeError, match="map_location should be"):
        hg.load(tmp_path / "x.pt", map_location=3.5)
    with pytest.raises(NotImplementedError, match="mmap=False"):
        hg.load(tmp_path / "x.pt", mmap=True)


@pytest.mark.skipif(hg.cuda.is_available(), reason="the error is for machines without a GPU")
def test_map_location_cuda_without_a_gpu_gives_pytorchs_error(tmp_path):
    hg.save({"t": hg.ones(2)}, tmp_path / "x.pt")
    with pytest.raises(RuntimeError, match=r"Attempting to deserialize object on a CUDA device "
                                           r"but torch.cuda.is_available\(\) is False"):
        hg.load(tmp_path / "x.pt", map_location="cuda")


def test_failed_saves_leave_the_old_file_intact(tmp_path, monkeypatch):
    path = tmp_path / "model.pt"
    hg.save({"w": hg.ones(2)}, path)
    before = path.read_bytes()
    with pytest.raises(Exception):
        hg.save({"w": hg.zeros(2), "f": lambda: 0}, path)  # unpicklable: fails before writing

    def killed(phase, **where):
        raise KeyboardInterrupt("killed before the rename")

    monkeypatch.setattr(checkpoint, "_reached", killed)
    with pytest.raises(KeyboardInterrupt):
        hg.save({"w": hg.zeros(2)}, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["model.pt"]
    assert hg.load(path)["w"].array.tolist() == [1.0, 1.0]


def test_unreadable_files_name_the_file_and_the_problem(tmp_path):
    torch = pytest.importorskip("torch")
    path = tmp_path / "x.pt"
    hg.save({"w": hg.ones(100)}, path)
    path.write_bytes(path.read_bytes()[:-50])
    with pytest.raises((RuntimeError, OSError), match="x.pt"):
        hg.load(path)
    path.write_bytes(b"hello world")
    with pytest.raises(RuntimeError, match="not a file hpcgrad.save, torch.save or safetensors"):
        hg.load(path)
    torch.save({"w": torch.ones(2)}, path, _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError, match="legacy"):
        hg.load(path)
    with pytest.raises(RuntimeError, match="could not write"):
        hg.save({"w": hg.ones(2)}, tmp_path / "no such dir" / "x.pt")


def test_safetensors_suffix_chooses_the_format(tmp_path):
    st = pytest.importorskip("safetensors.numpy")
    sd = _model().state_dict()
    path = tmp_path / "model.safetensors"
    hg.save(sd, path)
    plain = st.load_file(str(path))  # the reference reader
    assert sorted(plain) == sorted(sd)
    for name, t in sd.items():
        np.testing.assert_array_equal(plain[name], t.array)
    back = hg.load(path)
    assert sorted(back) == sorted(sd) and all(type(v) is hg.Tensor for v in back.values())
    with open(path, "rb") as f:  # a file object: told by its bytes
        assert sorted(hg.load(f)) == sorted(sd)
    with pytest.raises(TypeError, match="a .safetensors file holds a dict of str -> Tensor"):
        hg.save({"w": hg.ones(2), "epoch": 3}, tmp_path / "bad.safetensors")
