import pytest

from twinkle.errors import ComponentNotFoundError, ConfigurationError
from twinkle.registry import Registry, build, factory, get_registry


class Scale:
    def __init__(self, factor: float = 2.0):
        self.factor = factor


def test_build_from_name_class_instance_and_import_path():
    registry = Registry("demo")
    registry.register(Scale)
    assert registry.build("Scale", factor=3.0).factor == 3.0
    assert registry.build(Scale).factor == 2.0
    instance = Scale(5.0)
    assert registry.build(instance) is instance
    assert registry.build(f"{__name__}:Scale", factor=4.0).factor == 4.0


def test_factories_and_aliases():
    registry = Registry("demo")

    @factory
    def make_scale(factor: float = 1.0) -> Scale:
        return Scale(factor * 10)

    registry.register(make_scale, name="default")
    assert registry.build("default", factor=2).factor == 20


def test_errors_name_the_problem():
    registry = Registry("demo")
    registry.register(Scale)
    with pytest.raises(ComponentNotFoundError, match="unknown demo 'Nope'; available: Scale"):
        registry.build("Nope")
    with pytest.raises(ConfigurationError, match="already an instance"):
        registry.build(Scale(), factor=1.0)
    with pytest.raises(ConfigurationError, match="cannot build demo Scale"):
        registry.build(Scale, bogus=1)
    with pytest.raises(ConfigurationError, match="already registered"):
        registry.register(type("Scale", (), {}))
    with pytest.raises(ComponentNotFoundError, match="cannot import demo"):
        registry.build("no_such_module_xyz:Thing")


def test_global_registries_and_entry_points():
    with pytest.raises(ComponentNotFoundError, match="unknown component kind"):
        get_registry("gizmo")
    with pytest.raises(ComponentNotFoundError, match="unknown loss 'DefinitelyMissingLoss'"):
        build("loss", "DefinitelyMissingLoss")
