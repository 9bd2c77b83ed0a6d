import pytest
import torch

from twinkle.errors import ComponentNotFoundError, ConfigurationError
from twinkle.module import build_optimizer, keeping_implementation, optimizer_class


def test_names_classes_and_default():
    assert optimizer_class("AdamW") is torch.optim.AdamW
    assert optimizer_class("default") is torch.optim.AdamW
    assert optimizer_class(torch.optim.SGD) is torch.optim.SGD
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert build_optimizer("SGD", params, lr=0.5).param_groups[0]["lr"] == 0.5


def test_errors_are_clear():
    params = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ComponentNotFoundError, match=r"unknown optimizer 'Adamw'.*AdamW"):
        optimizer_class("Adamw")
    with pytest.raises(ConfigurationError, match="cannot build optimizer AdamW"):
        build_optimizer("AdamW", params, lr=-1.0)
    with pytest.raises(ConfigurationError, match="not an instance"):
        build_optimizer(torch.optim.SGD(params, lr=0.1), params)
    with pytest.raises(ConfigurationError, match=r"not a torch\.optim\.Optimizer"):
        optimizer_class(dict)


def _steps(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
    for grad in grads:
        for param in params:
            param.grad = grad.clone()
        optimizer.step()


def test_cpu_parameters_get_the_fused_kernel_with_plain_torch_results():
    torch.manual_seed(0)  # float64: the two kernels round differently, far below the tolerance on any CPU
    start = torch.randn(3, 5, dtype=torch.float64)
    grads = [torch.randn(3, 5, dtype=torch.float64) for _ in range(4)]
    ours = [torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone() * 2)]
    plain = [torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone() * 2)]
    optimizer = build_optimizer("AdamW", (param for param in ours), lr=0.1, weight_decay=0.01)  # a generator too
    assert optimizer.defaults["fused"] is True
    _steps(optimizer, ours, grads)
    _steps(torch.optim.AdamW(plain, lr=0.1, weight_decay=0.01), plain, grads)
    for got, want in zip(ours, plain, strict=True):
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-12, rtol=0)


def test_the_callers_implementation_choice_and_optimizers_without_a_fused_kernel_are_left_alone():
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert not build_optimizer("AdamW", params, lr=0.1, foreach=False).defaults["fused"]
    assert not build_optimizer("AdamW", [{"params": params, "lr": 0.2}], lr=0.1, foreach=True).defaults["fused"]
    assert build_optimizer("AdamW", [{"params": params, "lr": 0.2}], lr=0.1).defaults["fused"] is True
    assert "fused" not in build_optimizer("RMSprop", params, lr=0.1).defaults


def test_a_loaded_state_keeps_the_loading_optimizers_implementation():
    """A checkpoint written with the fused CPU kernel must not ask for it where it was not chosen."""
    saved_params = [torch.nn.Parameter(torch.ones(3))]
    saved = build_optimizer("AdamW", saved_params, lr=0.1)
    _steps(saved, saved_params, [torch.ones(3)])
    params = [torch.nn.Parameter(torch.ones(3))]
    loading = build_optimizer("AdamW", params, lr=0.5, foreach=True)
    loading.load_state_dict(keeping_implementation(saved.state_dict(), loading))
    group = loading.param_groups[0]
    assert not group["fused"] and group["foreach"] is True
    assert group["lr"] == 0.1, "the training state (hyper-parameters, moments) is the checkpoint's"
    torch.testing.assert_close(loading.state[params[0]]["exp_avg"], saved.state[saved_params[0]]["exp_avg"])
