"""Module: registration order, state_dict round trips and errors, modes, hooks, buffers, repr."""

import collections
import copy
from types import SimpleNamespace

import numpy as np
import pytest

import hpcgrad as hg
import hpcgrad.nn as nn
from hpcgrad.nn import Parameter

HG = SimpleNamespace(nn=nn, zeros=lambda *s: hg.zeros(*s))


def make_net(L):
    """The same small model for hpcgrad and torch: nested children, a shared layer, buffers."""

    class Block(L.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = L.nn.Conv2d(2, 3, 3, padding=1)
            self.bn = L.nn.BatchNorm2d(3)
            self.register_buffer("scale", L.zeros(3))
            self.register_buffer("scratch", L.zeros(2), persistent=False)

        def forward(self, x):
            return self.bn(self.conv(x)).relu()

    class Net(L.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = L.nn.Parameter(L.zeros(1))
            self.body = L.nn.Sequential(Block(), L.nn.MaxPool2d(2))
            self.heads = L.nn.ModuleList([L.nn.Linear(12, 4), L.nn.Linear(4, 2)])
            self.alias = self.heads[1]  # shared: its parameters appear once
            self.dropout = L.nn.Dropout(0.5)

        def forward(self, x):
            h = self.body(x).flatten(1)
            return self.heads[1](self.dropout(self.heads[0](h)).relu()) * self.scale

    return Net()


NET_PARAMS = ["scale", "body.0.conv.weight", "body.0.conv.bias", "body.0.bn.weight",
              "body.0.bn.bias", "heads.0.weight", "heads.0.bias", "heads.1.weight",
              "heads.1.bias"]


def test_named_parameters_registration_order_dotted_and_deduplicated():
    net = make_net(HG)
    assert [n for n, _ in net.named_parameters()] == NET_PARAMS
    assert len(list(net.parameters())) == len(NET_PARAMS)
    names = [n for n, _ in net.named_parameters(remove_duplicate=False)]
    assert names[-2:] == ["alias.weight", "alias.bias"]
    assert [n for n, _ in net.named_parameters(recurse=False)] == ["scale"]
    assert [n for n, _ in net.named_children()] == ["body", "heads", "alias", "dropout"]
    assert [n for n, _ in net.named_modules()] == [
        "", "body", "body.0", "body.0.conv", "body.0.bn", "body.1", "heads", "heads.0",
        "heads.1", "dropout"]
    assert net.get_submodule("body.0.bn") is net.body[0].bn
    assert [n for n, _ in net.named_buffers()] == [
        "body.0.scale", "body.0.scratch", "body.0.bn.running_mean", "body.0.bn.running_var",
        "body.0.bn.num_batches_tracked"]


def test_parameter_is_a_leaf_tensor_that_accumulates_grad():
    data = hg.tensor(np.arange(3.0))
    p = Parameter(data)
    assert isinstance(p, Parameter) and isinstance(p, hg.Tensor)
    assert p.requires_grad and p.is_leaf and p.array is data.array
    assert not Parameter(hg.zeros(2), requires_grad=False).requires_grad
    (p * p).sum().backward()
    (p * 2.0).sum().backward()
    np.testing.assert_array_equal(p.grad.array, 2 * np.arange(3.0) + 2)
    assert type(p.detach()) is hg.Tensor
    assert repr(p).startswith("Parameter containing:\ntensor(")


def test_state_dict_order_values_and_torch_keys():
    net = make_net(HG)
    state = net.state_dict()
    assert isinstance(state, collections.OrderedDict)
    assert list(state) == [
        "scale", "body.0.scale", "body.0.conv.weight", "body.0.conv.bias", "body.0.bn.weight",
        "body.0.bn.bias", "body.0.bn.running_mean", "body.0.bn.running_var",
        "body.0.bn.num_batches_tracked", "heads.0.weight", "heads.0.bias", "heads.1.weight",
        "heads.1.bias", "alias.weight", "alias.bias"]  # a shared module under both names
    assert state["heads.0.weight"].array is net.heads[0].weight.array  # shares memory
    assert not state["heads.0.weight"].requires_grad
    assert net.state_dict(keep_vars=True)["scale"] is net.scale
    torch = pytest.importorskip("torch")
    assert list(state) == list(make_net(SimpleNamespace(nn=torch.nn, zeros=torch.zeros))
                               .state_dict())


def test_load_state_dict_copies_in_place():
    source, target = make_net(HG), make_net(HG)
    for p in source.parameters():
        p.array[...] = np.random.default_rng(0).standard_normal(p.shape)
    source.body[0].bn.num_batches_tracked.array[...] = 7
    arrays = {name: t.array for name, t in target.state_dict().items()}
    result = target.load_state_dict(source.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    for name, value in target.state_dict().items():
        assert value.array is arrays[name]  # the same arrays: optimizers keep their references
        np.testing.assert_array_equal(value.array, source.state_dict()[name].array)
    # plain arrays are accepted too
    target.load_state_dict({k: v.array * 2 for k, v in source.state_dict().items()})
    np.testing.assert_array_equal(target.scale.array, source.scale.array * 2)


def _broken_state(kind):
    state = make_net(HG).state_dict()
    if kind == "missing":
        del state["heads.1.bias"]
    elif kind == "unexpected":
        state["heads.2.weight"] = hg.zeros(2)
    else:
        state["body.0.conv.weight"] = hg.zeros(3, 2, 5, 5)
    return state


@pytest.mark.parametrize("kind, match", [
    ("missing", r'Missing key\(s\) in state_dict: "heads.1.bias"'),
    ("unexpected", r'Unexpected key\(s\) in state_dict: "heads.2.weight"'),
    ("shape", r"size mismatch for body.0.conv.weight: copying a param with shape "
              r"\[3, 2, 5, 5\] from checkpoint, the shape in current model is \[3, 2, 3, 3\]"),
])
def test_load_state_dict_errors_name_the_keys_and_copy_nothing(kind, match):
    net = make_net(HG)
    before = {k: v.array.copy() for k, v in net.state_dict().items()}
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict for Net"):
        net.load_state_dict(_broken_state(kind))
    with pytest.raises(RuntimeError, match=match):
        net.load_state_dict(_broken_state(kind))
    for k, v in net.state_dict().items():
        np.testing.assert_array_equal(v.array, before[k])
    if kind == "shape":  # a shape mismatch is an error even when not strict
        with pytest.raises(RuntimeError, match="size mismatch"):
            net.load_state_dict(_broken_state(kind), strict=False)
    else:
        result = net.load_state_dict(_broken_state(kind), strict=False)
        assert result == ((["heads.1.bias"], []) if kind == "missing"
                          else ([], ["heads.2.weight"]))


def test_zero_grad_train_eval_and_requires_grad():
    net = make_net(HG)
    net(hg.randn(2, 2, 4, 4)).sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    net.zero_grad(set_to_none=False)
    assert all(p.grad is not None and not p.grad.array.any() for p in net.parameters())
    net.zero_grad()
    assert all(p.grad is None for p in net.parameters())
    assert net.training and all(m.training for m in net.modules())
    assert net.eval() is net and not any(m.training for m in net.modules())
    x = hg.randn(3, 4)
    assert net.dropout(x) is x  # the identity in eval mode
    net.train()
    assert all(m.training for m in net.modules())
    net.requires_grad_(False)
    assert not any(p.requires_grad for p in net.parameters())


def test_forward_hooks_modify_and_remove():
    lin = nn.Linear(3, 2)
    calls = []
    pre = lin.register_forward_pre_hook(lambda m, args: (args[0] * 0.0,))
    post = lin.register_forward_hook(lambda m, args, out: calls.append(("post", out)) or out + 1)
    first = lin.register_forward_hook(lambda m, args, out: calls.append(("first",)),
                                      prepend=True)
    x = hg.randn(4, 3)
    out = lin(x)
    np.testing.assert_allclose(out.array, np.broadcast_to(lin.bias.array + 1, (4, 2)))
    assert [c[0] for c in calls] == ["first", "post"]
    pre.remove()
    post.remove()
    first.remove()
    np.testing.assert_allclose(lin(x).array, x.array @ lin.weight.array.T + lin.bias.array,
                               rtol=1e-6)
    with lin.register_forward_pre_hook(lambda m, args, kwargs: ((args[0] * 2,), kwargs),
                                       with_kwargs=True):
        np.testing.assert_allclose(lin(x).array, 2 * x.array @ lin.weight.array.T + lin.bias.array,
                                   rtol=1e-6)
    assert not lin._forward_pre_hooks
    with pytest.raises(TypeError, match="callable"):
        lin.register_forward_hook(None)


def test_buffers_and_attribute_rules():
    m = nn.Module()
    m.register_buffer("stat", hg.zeros(2))
    m.register_buffer("tmp", hg.ones(1), persistent=False)
    m.stat = hg.ones(2)  # stays a buffer
    assert [n for n, _ in m.named_buffers()] == ["stat", "tmp"]
    assert list(m.state_dict()) == ["stat"]
    with pytest.raises(TypeError, match="buffer 'stat'"):
        m.stat = np.ones(2)
    m.w = Parameter(hg.zeros(2))
    with pytest.raises(TypeError, match="cannot assign 'Tensor' as parameter 'w'"):
        m.w = hg.zeros(2)
    m.w = None
    assert list(m.parameters()) == []
    with pytest.raises(TypeError, match="Parameter or None required"):
        m.register_parameter("v", hg.zeros(1))
    with pytest.raises(KeyError, match="already exists"):
        m.plain = 1
        m.register_buffer("plain", hg.zeros(1))
    del m.stat
    assert [n for n, _ in m.named_buffers()] == ["tmp"]

    class Early(nn.Module):
        def __init__(self):
            self.w = Parameter(hg.zeros(1))

    with pytest.raises(AttributeError, match="before Module.__init__"):
        Early()


def test_apply_to_dtype_and_deepcopy():
    net = make_net(HG)
    visited = []
    net.apply(lambda m: visited.append(type(m).__name__))
    assert visited[-1] == "Net" and visited.index("Conv2d") < visited.index("Block")
    params = list(net.parameters())
    net.double()
    assert [p is q for p, q in zip(params, net.parameters())] == [True] * len(params)
    assert all(p.dtype == np.float64 for p in net.parameters())
    assert net.body[0].bn.num_batches_tracked.dtype == np.int64
    out = net(hg.randn(2, 2, 4, 4).double())
    assert out.dtype == np.float64
    out.sum().backward()
    clone = copy.deepcopy(net)
    assert clone.heads[0].weight is not net.heads[0].weight
    assert clone.alias is clone.heads[1]  # sharing survives the copy
    clone.heads[0].weight.array[...] = 0
    assert net.heads[0].weight.array.any()
    with pytest.raises(TypeError, match="floating point"):
        net.to(np.int32)


def test_repr_matches_torch():
    torch = pytest.importorskip("torch")
    ours = make_net(HG)
    theirs = make_net(SimpleNamespace(nn=torch.nn, zeros=torch.zeros))
    assert repr(ours) == repr(theirs)
    for make in (lambda L: L.LayerNorm(4), lambda L: L.Embedding(5, 2, padding_idx=0),
                 lambda L: L.Conv2d(1, 2, 3, stride=2, padding=1, bias=False),
                 lambda L: L.Conv2d(1, 2, 3, padding="same", dilation=2),
                 lambda L: L.LayerNorm(4, bias=False), lambda L: L.BatchNorm2d(2, affine=False),
                 lambda L: L.GELU("tanh"), lambda L: L.Flatten(),
                 lambda L: L.BatchNorm1d(3, momentum=None)):
        assert repr(make(nn)) == repr(make(torch.nn))


def test_sequential_and_module_list():
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert len(seq) == 3 and isinstance(seq[-1], nn.Linear)
    head = seq[:2]
    assert isinstance(head, nn.Sequential) and head(hg.randn(4, 2)).shape == (4, 3)
    del seq[1]
    assert [n for n, _ in seq.named_children()] == ["0", "1"]
    seq.append(nn.Tanh())
    assert isinstance(seq[2], nn.Tanh)
    named = nn.Sequential(collections.OrderedDict(fc=nn.Linear(2, 2), act=nn.ReLU()))
    assert [n for n, _ in named.named_parameters()] == ["fc.weight", "fc.bias"]
    named[0] = nn.Linear(2, 2, bias=False)
    assert [n for n, _ in named.named_parameters()] == ["fc.weight"]

    layers = nn.ModuleList([nn.Linear(1, 1)])
    layers.append(nn.Linear(1, 2))
    layers.extend([nn.ReLU()])
    layers.insert(0, nn.Tanh())
    assert [type(m).__name__ for m in layers] == ["Tanh", "Linear", "Linear", "ReLU"]
    assert [n for n, _ in layers.named_parameters()] == ["1.weight", "1.bias", "2.weight",
                                                         "2.bias"]
    del layers[0]
    assert isinstance(layers[0], nn.Linear) and len(layers) == 3
    with pytest.raises(IndexError):
        layers[3]


@pytest.mark.parametrize("listing", ["named_parameters", "named_buffers", "named_modules",
                                     "named_children", "state_dict"])
def test_name_listings_match_torch(listing):
    torch = pytest.importorskip("torch")
    ours = make_net(HG)
    theirs = make_net(SimpleNamespace(nn=torch.nn, zeros=torch.zeros))
    names = lambda net: [item if isinstance(item, str) else item[0]  # noqa: E731
                         for item in getattr(net, listing)()]
    assert names(ours) == names(theirs)
    if listing == "state_dict":  # and torch's state_dict loads into ours
        ours.load_state_dict({k: v.numpy() for k, v in theirs.state_dict().items()})
        np.testing.assert_array_equal(ours.heads[0].weight.array, theirs.heads[0].weight.detach())
