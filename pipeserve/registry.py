"""One registry per config group with interchangeable options (kv, draft, cache, admission):
each option is declared once, by `@register(group, name)` on its schema dataclass, and
everything else is derived from it: the ConfigStore entries (`pipeserve.config.SCHEMAS`,
`register_configs()`), an option's `name` (`name_of`), the metric label values of the group
(`labels`), and the tests' check that pipeserve/conf/<group>/ holds exactly one YAML per option. Which
class implements an option is its schema's `_target_`, so the dispatch is the schema too.

A group's schemas live in its schema module (SCHEMA_MODULES), which imports no mlx: the config
is composed and checked at launch, before anything loads."""
from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

# group → the module that declares its options (imported by pipeserve.config)
SCHEMA_MODULES = {
    "kv": "pipeserve.kv.config",
    "draft": "pipeserve.draft.config",
    "cache": "pipeserve.prompt_cache.config",
    "admission": "pipeserve.stages.config",
    "distributed": "pipeserve.distributed.config",
}


@dataclass(frozen=True)
class Option:
    group: str
    name: str        # the YAML's stem (pipeserve/conf/<group>/<name>.yaml) and the CLI's `<group>=<name>`
    schema: type     # the dataclass its YAML extends (/schema/<group>/<name>@_here_)
    labelled: bool   # one of the values of the group's metric label (draft: `proposer`)


_OPTIONS: dict[str, dict[str, Option]] = {group: {} for group in SCHEMA_MODULES}

T = TypeVar("T", bound=type)


def register(group: str, *names: str, labelled: bool = True) -> Callable[[T], T]:
    """Class decorator: the schema is option `names` of `group` (several names when one schema
    serves several options that differ only in their YAML's values, as kv=q4 and kv=q8 do;
    such a schema defines `name` itself). `labelled=False`: not a metric label value (the
    group's "off" option, e.g. draft=none)."""
    if group not in _OPTIONS:
        raise ValueError(f"unknown config group {group!r}; registered groups: "
                         f"{', '.join(_OPTIONS)} (add it to SCHEMA_MODULES)")
    if not names:
        raise ValueError(f"register({group!r}) needs at least one option name")

    def add(schema: T) -> T:
        if not dataclasses.is_dataclass(schema):
            raise TypeError(f"{group}={names[0]}: {schema.__name__} is not a dataclass")
        for name in names:
            known = _OPTIONS[group].get(name)
            if known is not None and known.schema is not schema:
                raise ValueError(f"{group}={name} is registered twice: "
                                 f"{known.schema.__qualname__} and {schema.__qualname__}")
            _OPTIONS[group][name] = Option(group, name, schema, labelled)
        return schema
    return add


def _complete() -> None:
    for module in set(SCHEMA_MODULES.values()):
        importlib.import_module(module)


def options(group: str) -> dict[str, Option]:
    """The options of `group`, by name, in declaration order."""
    _complete()
    return dict(_OPTIONS[group])


class Schemas(Mapping[str, type]):
    """name → schema of one group, read from the registry on every access (so an option
    registered later, e.g. by a test, is seen): what ConfigStore stores as
    schema/<group>/<name>."""

    def __init__(self, group: str) -> None:
        if group not in _OPTIONS:
            raise ValueError(f"unknown config group {group!r}")
        self.group = group

    def __getitem__(self, name: str) -> type:
        return options(self.group)[name].schema

    def __iter__(self) -> Iterator[str]:
        return iter(options(self.group))

    def __len__(self) -> int:
        return len(options(self.group))

    def __repr__(self) -> str:
        return f"Schemas({self.group!r}: {', '.join(self)})"


def schemas(group: str) -> Schemas:
    return Schemas(group)


def labels(group: str) -> tuple[str, ...]:
    """The values the group's metric label takes (every option but the `labelled=False` one)."""
    return tuple(name for name, o in options(group).items() if o.labelled)


def name_of(cfg: Any) -> str:
    """The option a typed config node was built from (its schema's one registered name)."""
    found = [o.name for group in _OPTIONS.values() for o in group.values()
             if o.schema is type(cfg)]
    if len(found) != 1:
        raise TypeError(f"{type(cfg).__qualname__} is registered as {found or 'no option'}; "
                        "a schema registered under several names must define `name` itself")
    return found[0]
