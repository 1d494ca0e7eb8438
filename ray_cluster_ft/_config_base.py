"""The base of every config section (:mod:`ray_cluster_ft.config`): unknown keys forbidden, no YAML booleans
for numbers, no inf/nan; and the seed field every section shares."""

from __future__ import annotations

from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

__all__ = ["SEED_MAX", "Section", "seed_field"]

# Every seed reaches numpy / scikit-learn, which take seeds in [0, 2**32): check the range here, not after the
# sketch stage.
SEED_MAX = 2**32 - 1


def seed_field(description: str = "random seed") -> Any:
    return Field(0, ge=0, le=SEED_MAX, description=f"{description}, 0..2**32-1")


def _admits_bool(annotation: Any) -> bool:
    if annotation is bool or annotation is Any:
        return True
    return any(_admits_bool(a) for a in get_args(annotation) if not isinstance(a, str))


class Section(BaseModel):
    # allow_inf_nan=False: YAML's .inf / .nan are never a meaningful budget, rate or limit.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads YAML `true` as 1 for a number: `epochs: true` would train one epoch and
        # `lr: true` at 1.0. Only a field that is a boolean (or may be one) takes a boolean.
        if isinstance(v, bool) and not _admits_bool(cls.model_fields[info.field_name].annotation):
            raise ValueError("does not take a boolean (YAML true/false)")
        return v
