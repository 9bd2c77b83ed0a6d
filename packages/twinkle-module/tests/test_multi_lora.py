import copy
import gc
import weakref

import pytest
import torch

from twinkle.errors import ConfigurationError, InvalidInputError
from twinkle.module import (
    MultiLoraLinear,
    adapter_names,
    adapter_rows,
    inject_multi_lora,
    multi_lora_modules,
    per_token,
    remove_adapter,
    set_adapter_weights,
)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Three adapters of different ranks; "z" adapts only part of the projections.
ADAPTERS = {"x": (1, PROJECTIONS), "y": (8, PROJECTIONS), "z": (32, ["q_proj", "v_proj", "down_proj"])}


@pytest.fixture(scope="module")
def base_model():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    return transformers.Qwen3ForCausalLM(config).eval()


def _peft_model(base_model, name):
    rank, targets = ADAPTERS[name]
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank + 1, target_modules=targets, lora_dropout=0.0)
    model = peft.get_peft_model(copy.deepcopy(base_model), config, adapter_name=name)
    generator = torch.Generator().manual_seed(rank)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_" in param_name:
                param.normal_(0, 0.2, generator=generator)
    return model.eval()


def _tensors_and_scaling(peft_model, name):
    """What a caller passes to set_adapter_weights: ``{module_name: (A, B)}`` and the scaling of each module."""
    tensors, scaling = {}, {}
    for module_name, module in peft_model.get_base_model().named_modules():
        if isinstance(module, peft.tuners.lora.LoraLayer) and name in module.lora_A:
            tensors[module_name] = (module.lora_A[name].weight, module.lora_B[name].weight)
            scaling[module_name] = module.scaling[name]
    return tensors, scaling


@pytest.fixture(scope="module")
def peft_models(base_model):
    return {name: _peft_model(base_model, name) for name in ADAPTERS}


@pytest.fixture
def multi_model(base_model, peft_models):
    model = copy.deepcopy(base_model)
    inject_multi_lora(model, PROJECTIONS)
    for name, peft_model in peft_models.items():
        tensors, scaling = _tensors_and_scaling(peft_model, name)
        set_adapter_weights(model, name, {k: (a.detach(), b.detach()) for k, (a, b) in tensors.items()}, scaling)
    return model


def _input_ids(rows):
    return torch.randint(0, 128, (rows, 7), generator=torch.Generator().manual_seed(1))


def test_mixed_batch_rows_match_peft_per_adapter_and_base_for_none(base_model, peft_models, multi_model):
    row_adapters = ["x", None, "y", "z", "x", None, "z"]
    input_ids = _input_ids(len(row_adapters))
    with torch.no_grad(), adapter_rows(multi_model, row_adapters):
        logits = multi_model(input_ids).logits
    with torch.no_grad():
        for row, name in enumerate(row_adapters):
            reference = (peft_models[name] if name else base_model)(input_ids[row : row + 1]).logits[0]
            torch.testing.assert_close(logits[row], reference, atol=1e-5, rtol=0, msg=f"row {row} ({name})")


def test_adapters_really_change_the_output(base_model, multi_model):
    input_ids = _input_ids(3)
    with torch.no_grad(), adapter_rows(multi_model, ["x", "y", "z"]):
        adapted = multi_model(input_ids).logits
        base = base_model(input_ids).logits
    for row in range(3):
        assert (adapted[row] - base[row]).abs().max() > 1e-2


def test_outside_adapter_rows_every_row_is_the_base_model(base_model, multi_model):
    input_ids = _input_ids(2)
    with torch.no_grad():
        torch.testing.assert_close(multi_model(input_ids).logits, base_model(input_ids).logits, atol=1e-6, rtol=0)


def test_gradients_reach_adapter_tensors_like_peft(base_model, peft_models):
    model = copy.deepcopy(base_model)
    inject_multi_lora(model, PROJECTIONS)
    trainable = {}
    for name in ("x", "y"):
        tensors, scaling = _tensors_and_scaling(peft_models[name], name)
        trainable[name] = {
            k: (a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_())
            for k, (a, b) in tensors.items()
        }
        set_adapter_weights(model, name, trainable[name], scaling)
    input_ids = _input_ids(4)
    weights = torch.randn(4, 7, 128, generator=torch.Generator().manual_seed(2))
    with adapter_rows(model, ["x", "y", None, "x"]):
        (model(input_ids).logits * weights).sum().backward()

    assert all(layer.weight.grad is None for layer in multi_lora_modules(model).values()), "the base stays frozen"
    peft_x = copy.deepcopy(peft_models["x"])
    rows_x = [0, 3]
    (peft_x(input_ids[rows_x]).logits * weights[rows_x]).sum().backward()
    for module_name, (A, B) in trainable["x"].items():
        layer = peft_x.get_base_model().get_submodule(module_name)
        torch.testing.assert_close(A.grad, layer.lora_A["x"].weight.grad, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(B.grad, layer.lora_B["x"].weight.grad, atol=1e-4, rtol=1e-4)
    assert all(A.grad is not None and A.grad.abs().sum() > 0 for A, _ in trainable["y"].values())


def test_injection_is_idempotent_and_keeps_state_dict_keys(base_model):
    model = copy.deepcopy(base_model)
    first = inject_multi_lora(model, PROJECTIONS)
    wrapped = multi_lora_modules(model)
    second = inject_multi_lora(model, ["q_proj"])
    assert len(first) == 2 * len(PROJECTIONS) and set(second) <= set(first)
    assert multi_lora_modules(model) == wrapped, "nothing is wrapped twice"
    assert list(model.state_dict()) == list(base_model.state_dict())
    layer = model.model.layers[0].self_attn.q_proj
    assert isinstance(layer, MultiLoraLinear) and not layer.weight.requires_grad


def test_regex_targets_and_unmatched_targets(base_model):
    model = copy.deepcopy(base_model)
    assert inject_multi_lora(model, r".*\.0\.self_attn\.(q|v)_proj") == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
    ]
    with pytest.raises(ConfigurationError, match=r"match no nn\.Linear"):
        inject_multi_lora(model, ["no_such_proj"])


def test_replacing_and_removing_adapters_frees_their_tensors(multi_model):
    assert adapter_names(multi_model) == ["x", "y", "z"]
    A = torch.zeros(2, 32)
    probe = weakref.ref(A)
    set_adapter_weights(multi_model, "x", {"model.layers.0.self_attn.q_proj": (A, torch.zeros(32, 2))}, 1.0)
    assert multi_model.model.layers[1].self_attn.q_proj.adapters.get("x") is None, "the old version is gone"
    del A
    remove_adapter(multi_model, "x")
    gc.collect()
    assert probe() is None
    assert adapter_names(multi_model) == ["y", "z"]
    with pytest.raises(InvalidInputError, match="unknown adapter 'x'"):
        remove_adapter(multi_model, "x")


def test_bad_inputs_are_rejected_by_name(base_model, multi_model):
    with pytest.raises(InvalidInputError, match=r"unknown adapter\(s\) \['zzz'\]"), adapter_rows(multi_model, ["zzz"]):
        pass
    with torch.no_grad(), adapter_rows(multi_model, ["x", "y"]), pytest.raises(InvalidInputError, match="2 rows"):
        multi_model(_input_ids(3))
    q_proj = "model.layers.0.self_attn.q_proj"
    with pytest.raises(InvalidInputError, match="A must be"):
        set_adapter_weights(multi_model, "d", {q_proj: (torch.zeros(4, 31), torch.zeros(32, 4))}, 1.0)
    with pytest.raises(InvalidInputError, match="no scaling"):
        set_adapter_weights(multi_model, "d", {q_proj: (torch.zeros(4, 32), torch.zeros(32, 4))}, {})
    plain = copy.deepcopy(base_model)
    with pytest.raises(ConfigurationError, match="inject_multi_lora"):
        set_adapter_weights(plain, "d", {q_proj: (torch.zeros(4, 32), torch.zeros(32, 4))}, 1.0)
    assert "d" not in adapter_names(multi_model), "a rejected adapter leaves nothing behind"


def test_nested_adapter_rows_restore_the_outer_assignment(multi_model):
    layer = multi_model.model.layers[0].self_attn.q_proj
    with adapter_rows(multi_model, ["x", "y"]) as outer:
        with adapter_rows(multi_model, ["z"]):
            assert layer.routing.batch_size == 1
        assert layer.routing is outer
    assert layer.routing is None


def test_flattened_tokens_get_their_rows_adapters_even_after_the_block():
    """An output layer run on some positions of a batch, flattened (as the chunked log-probs do)."""
    torch.manual_seed(0)
    # float64: a flattened and a batched matmul may sum in different orders.
    layer = MultiLoraLinear(torch.nn.Linear(6, 5, bias=False, dtype=torch.float64))
    for name, rank in (("x", 2), ("y", 3)):
        layer.adapters[name] = layer.checked_weights(name, torch.randn(rank, 6), torch.randn(5, rank), 0.5)
    x_BTI = torch.randn(3, 4, 6, dtype=torch.float64)
    kept_BT = torch.rand(3, 4, generator=torch.Generator().manual_seed(1)) > 0.4
    x_NI, rows_N = x_BTI[kept_BT], kept_BT.nonzero(as_tuple=True)[0]
    with adapter_rows(layer, ["x", None, "y"]):
        expected_NO = layer(x_BTI)[kept_BT]
        tokens = per_token(layer, rows_N)
        terms = layer.low_rank_terms(x_NI, rows_N)
    # The assignment was taken inside the block: a recomputation after it (checkpointed backward) agrees.
    torch.testing.assert_close(tokens(x_NI), expected_NO, atol=1e-12, rtol=1e-12)
    # The same update as low-rank terms: weight, plus u @ B.T on each adapter's tokens (none for row 1).
    row_1_tokens = (rows_N == 1).nonzero(as_tuple=True)[0]
    assert len(terms) == 2 and not torch.isin(torch.cat([t.positions_n for t in terms]), row_1_tokens).any()
    out_NO = x_NI @ layer.weight.T
    for term in terms:
        out_NO = out_NO.index_add(0, term.positions_n, term.u_nR @ term.B_VR.T)
    torch.testing.assert_close(out_NO, expected_NO, atol=1e-12, rtol=1e-12)
    with adapter_rows(layer, [None, None, None]):
        assert layer.low_rank_terms(x_NI, rows_N) == []
    plain = torch.nn.Linear(6, 5)
    assert per_token(plain, rows_N) is plain and per_token(layer, rows_N) is layer  # outside a block: as it is
