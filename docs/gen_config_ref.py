"""The configuration reference, generated from the config models (never copied by hand).

Each pydantic section (``trainer.TrainerConfig`` and its sections, the ``online:`` section of
``agentloop serve --train``, the ``sft:`` section of ``agentloop sft``, a job file's ``reward.judge``)
becomes one table of dotted key, type, default and the field's own description.

Two uses:
- an MkDocs hook (``hooks:`` in mkdocs.yml): ``<!-- config-reference -->`` in a page is replaced by the
  tables when the site builds, so ``make docs`` always shows the models as they are;
- ``python docs/gen_config_ref.py``: prints the same Markdown.

It imports the models only (pydantic, no torch model is built) and mkdocs not at all, so the tests can
render it without the docs tools installed.
"""

from __future__ import annotations

import importlib
import json
import logging
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

MARKER = "<!-- config-reference -->"

# (heading, where the keys sit, "module:Class", what it is); the trainer's sections come from
# TrainerConfig itself, one table per top-level field
SECTIONS = [
    ("TrainerConfig", "", "trainer:TrainerConfig", "`Trainer(config)`, a job file, `--set KEY=VALUE`."),
    ("online", "online", "trainer.online:OnlineConfig", "`agentloop serve --train CONFIG.yaml`'s `online:` section."),
    ("sft", "sft", "trainer.sft.config:SFTConfig", "`agentloop sft`'s `sft:` section (the RL keys above apply too)."),
    ("reward.judge", "reward.judge", "agentloop.judge.config:JudgeConfig", "A job file's `reward: {judge: {...}}` (`al.judge_reward`'s options)."),
]  # fmt: skip


def _load(spec: str) -> type[BaseModel]:
    module, _, name = spec.partition(":")
    model = getattr(importlib.import_module(module), name)
    assert isinstance(model, type) and issubclass(model, BaseModel), f"{spec} is not a pydantic model"
    return model


def _section_of(annotation: Any) -> type[BaseModel] | None:
    """The model class of a field that is a section (``X`` or ``X | None``), else None."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if args and len(args) == 1 and len(typing.get_args(annotation)) == 2:
        annotation = args[0]
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(repr(a).replace("'", '"') for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(annotation)[0])
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if isinstance(annotation, type) and issubclass(annotation, Enum):
        return " \\| ".join(f'"{m.value}"' for m in annotation)
    return getattr(annotation, "__name__", str(annotation)).replace("|", "\\|")


def _default(field: Any, value: Any = PydanticUndefined) -> str:
    """The field's default; ``value``: the value it has in a default-built parent, where there is one (a
    parent's default factory may set it otherwise, e.g. the critic's own learning rate)."""
    if value is not PydanticUndefined:
        pass
    elif field.default_factory is not None:
        try:
            value = field.default_factory()
        except TypeError:  # a factory that takes the validated data
            return "(computed)"
    elif field.default is PydanticUndefined:
        return "(required)"
    else:
        value = field.default
    if isinstance(value, BaseModel):
        return "(section)"
    if isinstance(value, Enum):
        value = value.value
    try:
        text = json.dumps(value)  # YAML's flow spelling: null, true, "grpo", ["console", "jsonl"]
    except TypeError:
        text = repr(value)
    if len(text) > 60:  # a long text default (the judge's rubric): its start, and the field says what it is
        text = text[:50] + "..."
    return f"`{text}`".replace("|", "\\|")


def _cell(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def _built(model: type[BaseModel]) -> BaseModel | None:
    try:
        return model()
    except Exception:  # a section with required keys: its fields' own defaults are shown
        return None


def rows(
    model: type[BaseModel], prefix: str = "", built: BaseModel | None = None
) -> list[tuple[str, str, str, str]]:
    """(dotted key, type, default, description) of every leaf field, sections expanded in place; the
    defaults are read from a default-built instance (``built``), so a section's factory counts."""
    if built is None and not prefix:
        built = _built(model)
    out: list[tuple[str, str, str, str]] = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{name}" if prefix else name
        value = getattr(built, name) if built is not None else PydanticUndefined
        sub = _section_of(field.annotation)
        if sub is not None:
            out.extend(rows(sub, key, value if isinstance(value, BaseModel) else _built(sub)))
        else:
            kind = _type_name(field.annotation)
            out.append((key, kind, _default(field, value), _cell(field.description)))
    return out


def _table(rows_: list[tuple[str, str, str, str]]) -> list[str]:
    lines = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    lines += [f"| `{key}` | {kind} | {default} | {meaning} |" for key, kind, default, meaning in rows_]
    return lines


def render() -> str:
    """The Markdown of the whole reference: one table per trainer section, then online, sft, judge."""
    lines: list[str] = []
    for heading, prefix, spec, what in SECTIONS:
        model = _load(spec)
        if prefix:
            lines += [f"### `{heading}`", "", what, "", *_table(rows(model, prefix, _built(model))), ""]
            continue
        lines += [f"{what}", ""]
        root = model()
        for name, field in model.model_fields.items():
            sub = _section_of(field.annotation)
            assert sub is not None, f"TrainerConfig.{name} is not a section"
            section = rows(sub, name, getattr(root, name))
            lines += [f"### `{name}`", "", _cell(field.description), "", *_table(section), ""]
    return "\n".join(lines).rstrip() + "\n"


# ---------------------------------------------------------------- the MkDocs hook

log = logging.getLogger("mkdocs.hooks.gen_config_ref")
OPTIONAL_PAGES = {"tinker.md"}  # written beside this site by other work; in the nav only once it exists


def on_config(config: Any) -> Any:
    """Drop nav entries of optional pages that are not there yet, so ``--strict`` does not fail on them."""
    docs = Path(config["docs_dir"])

    def keep(item: Any) -> bool:
        page = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(page, str) and page in OPTIONAL_PAGES and not (docs / page).is_file():
            log.info("nav: %s is not written yet; left out of the nav", page)
            return False
        return True

    if config.get("nav"):
        config["nav"] = [item for item in config["nav"] if keep(item)]
    return config


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown


if __name__ == "__main__":
    print(render(), end="")
