"""Reading a transformer config dataclass from diffusers' `config.json`: what every family's config reads alike.

A family's config is a dataclass with diffusers' names that mixes in `DiffusersTransformerConfig` and states, as
class attributes, the keys it skips without a word (`_IGNORED_KEYS`) and the fields JSON gives as lists that it
holds as tuples (`_TUPLE_FIELDS`); its `check_supported` refuses what composer does not run. A family whose
`config.json` has more than one naming (Wan's original release) translates it and calls `super().from_dict`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, TypeVar

from composer._fields import field_types, json_field_problems
from composer.errors import ModelFormatError
from composer.logging import get_logger

logger = get_logger(__name__)

# What diffusers' `save_pretrained` writes into config.json besides the constructor's arguments.
DIFFUSERS_METADATA_KEYS = frozenset({"_class_name", "_diffusers_version", "_name_or_path"})

_Config = TypeVar("_Config", bound="DiffusersTransformerConfig")


class DiffusersTransformerConfig:
    """`from_dict` for a transformer config dataclass, parameterised by the class attributes below."""

    # keys of config.json that are no field and are skipped silently (other unknown keys are logged at debug level)
    _IGNORED_KEYS: ClassVar[frozenset[str]] = DIFFUSERS_METADATA_KEYS
    # fields JSON gives as lists, held as tuples
    _TUPLE_FIELDS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_dict(cls: type[_Config], raw: dict[str, Any], source: str = "the transformer config") -> _Config:
        """From diffusers' config.json; a value of the wrong JSON type is a ModelFormatError naming `source`, the
        field, what it expects and the value."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known - cls._IGNORED_KEYS)
        if unknown:
            logger.debug("ignoring transformer config keys %s", unknown)
        values = {k: v for k, v in raw.items() if k in known}
        if "out_channels" in values and not values["out_channels"]:  # diffusers' `out_channels or in_channels`
            values["out_channels"] = values.get("in_channels", cls.in_channels)
        problems = json_field_problems(values, field_types(cls))
        if problems:
            raise ModelFormatError(f"{source}: {'; '.join(problems)}")
        for name in cls._TUPLE_FIELDS:
            if name in values:
                values[name] = tuple(values[name])
        config = cls(**values)
        config.check_supported()
        return config

    def check_supported(self) -> None:
        """Refuse a config composer does not run (UnsupportedError) or that does not fit together (ModelFormatError)."""
