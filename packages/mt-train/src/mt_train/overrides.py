"""Adjusting a recipe: a TOML file, then ``key=value`` overrides with dotted keys.

Both act on the nested-dict form of a `JobConfig`; the result is rebuilt with
`JobConfig.from_dict`, so every dataclass validates the final values. An unknown key
fails with the closest valid key. A value takes the type of the one it replaces; a key
that is None now (``model.sliding_window``) takes the type its dataclass field declares
(``int | None``), and ``null`` sets a field that may be None to None.

A dict-valued field (``model.rope_scaling``) takes a TOML table key by key, as a section
does (TOML does not tell ``[model.rope_scaling]`` from an inline table, and a partial table
must not drop ``rope_type``); a JSON object on the command line replaces it whole, which is
how keys are added or removed.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from mt_train.config import JobConfig

_FIXED_KEYS = {"model_family"}


def flatten(
    data: dict[str, Any], prefix: str = "", leaves: frozenset[str] = frozenset()
) -> dict[str, Any]:
    """Returns {"a.b.c": value} for every leaf of a nested dict.

    Args:
        data: the nested dict.
        prefix: the dotted path of `data`.
        leaves: dotted keys whose dict values stay whole (a TOML table for a dict-valued
            field that is None now, such as ``model.rope_scaling``).

    Returns:
        The leaves by dotted key.
    """
    flat = {}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and dotted not in leaves:
            flat.update(flatten(value, dotted + ".", leaves))
        else:
            flat[dotted] = value
    return flat


def _unknown_key_error(key: str, known: dict[str, Any], where: str) -> ValueError:
    """The error for a key that names no settable value: the family key, a whole section
    (``training=3``), a key below a single value (``training.max_steps.x``), or a typo."""
    if key in _FIXED_KEYS:
        return ValueError(
            f"{key} cannot be set (in {where}): the recipe fixes the model family; start "
            "from a recipe of the family you want (mt-train pretrain --help lists them)"
        )
    inside = [k for k in known if k.startswith(key + ".")]
    if inside:
        return ValueError(
            f"{key!r} is a section of the config, not one value (in {where}); set its keys, "
            f"e.g. {inside[0]}=VALUE (--print-config shows them all)"
        )
    parts = key.split(".")
    for end in range(len(parts) - 1, 0, -1):
        above = ".".join(parts[:end])
        if above in known:
            return ValueError(
                f"unknown config key {key!r} in {where}: {above} is one value "
                f"({known[above]!r}), not a section; write {above}=VALUE"
            )
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if not close:  # match on the last component alone ("max_step" -> training.max_steps)
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in known}
        leaf = difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_leaf), n=1)
        close = [by_leaf[leaf[0]]] if leaf else []
    hint = f"; did you mean {close[0]!r}?" if close else "; see --print-config for all keys"
    return ValueError(f"unknown config key {key!r} in {where}{hint}")


def field_types(config: Any, prefix: str = "") -> dict[str, Any]:
    """Returns {"a.b": declared type} for every dataclass field under `config`.

    Args:
        config: a dataclass instance (a `JobConfig`, its sections, the model config).
        prefix: the dotted path of `config`.

    Returns:
        The declared types (annotations) of the leaf fields, by dotted key.
    """
    try:
        hints = typing.get_type_hints(type(config))
    except (NameError, TypeError):  # an annotation that does not resolve: types unknown
        hints = {}
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            out.update(field_types(value, f"{prefix}{f.name}."))
        else:
            out[f"{prefix}{f.name}"] = hints.get(f.name, Any)
    return out


def _union_members(declared: Any) -> tuple[Any, ...] | None:
    """The members of an ``X | None`` annotation (origins of generics), or None."""
    if typing.get_origin(declared) not in (typing.Union, types.UnionType):
        return None
    return tuple(typing.get_origin(t) or t for t in typing.get_args(declared))


def _declared_name(declared: Any) -> str:
    """``int | None`` for an ``int | None`` annotation."""
    members = _union_members(declared) or (declared,)
    return " | ".join("None" if t is type(None) else getattr(t, "__name__", str(t))
                      for t in members)  # fmt: skip


def _as_declared(value: Any, declared: Any) -> Any:
    """Checks a value given for a key that is None now against its field's ``X | None``
    type (an int for ``int | None``, ...); other annotations pass it through.

    Raises:
        ValueError: the value has none of the declared types.
    """
    members = _union_members(declared)
    if members is None:
        if not isinstance(declared, type) and typing.get_origin(declared) is None:
            return value  # Any, or an annotation we do not read: unchecked
        members = (typing.get_origin(declared) or declared,)
    if value is None and type(None) in members:
        return value
    allowed = [t for t in members if t is not type(None)]
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if any(isinstance(value, t) and not (isinstance(value, bool) and t is int) for t in allowed):
        return _typed_items(value, [], declared) if isinstance(value, list) else value
    expected = _declared_name(declared)
    raise ValueError(f"{value!r} has type {type(value).__name__}, expected {expected}")


def _element_type(current: list | tuple, declared: Any) -> Any:
    """The item type of a list field: declared (``list[str]``), else its items' own
    when they share one; None when unknown."""
    candidates = typing.get_args(declared) if _union_members(declared) else (declared,)
    for t in candidates:
        if typing.get_origin(t) in (list, tuple):
            args = [a for a in typing.get_args(t) if a is not Ellipsis]
            if args:
                return args[0]
    kinds = {type(item) for item in current}
    return kinds.pop() if len(kinds) == 1 else None


def _typed_items(items: list, current: list | tuple, declared: Any) -> list:
    """The items of a value given for a list field, checked against its item type
    (`_element_type`); an int in a list of floats becomes a float.

    Raises:
        ValueError: an item has another type (a bool is no int).
    """
    kind = _element_type(current, declared)
    if kind not in (int, float, str, bool):
        return list(items)  # unknown: unchecked
    checked = []
    for item in items:
        if kind is float and isinstance(item, int) and not isinstance(item, bool):
            item = float(item)
        if not isinstance(item, kind) or (kind is int and isinstance(item, bool)):
            raise ValueError(
                f"item {item!r} has type {type(item).__name__}, expected {kind.__name__}"
            )
        checked.append(item)
    return checked


def parse_value(text: str, current: Any, key: str, declared: Any = Any) -> Any:
    """Parses the text of one override into the type of the value it replaces.

    Args:
        text: the part after '=' on the command line.
        current: the value the key has now (gives the type).
        key: the dotted key, for error messages.
        declared: the field's declared type; gives the type when `current` is None, and
            lets ``null`` set an ``X | None`` field to None.

    Returns:
        The parsed value.
    """
    members = _union_members(declared) or ()
    if type(None) in members and text.strip().lower() == "null":
        return None
    if current is None and str in members:
        return text
    try:
        if isinstance(current, bool):
            lowered = text.strip().lower()
            if lowered in ("true", "1", "yes", "on"):
                return True
            if lowered in ("false", "0", "no", "off"):
                return False
            raise ValueError("expected true or false")
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
        if isinstance(current, (list, tuple)):
            stripped = text.strip()
            if stripped.startswith("["):
                parsed = json.loads(stripped)
            else:  # a,b,c; words stand for themselves in a list of strings
                words = _element_type(current, declared) is str
                parsed = [
                    p.strip() if words and not p.strip().startswith('"') else json.loads(p)
                    for p in stripped.split(",") if p.strip()
                ]  # fmt: skip
            return type(current)(_typed_items(parsed, current, declared))
        if current is None or isinstance(current, dict):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                parsed = text
            return _as_declared(parsed, declared)
        return text
    except (ValueError, json.JSONDecodeError) as err:
        whole = current is None or isinstance(current, dict)
        kind = _declared_name(declared) if whole else type(current).__name__
        raise ValueError(
            f"cannot parse {key}={text!r} as {kind} (current value {current!r}): {err}"
        ) from None


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = value


def _merge_toml(
    data: dict[str, Any],
    table: dict[str, Any],
    known: dict[str, Any],
    path: str,
    declared: dict[str, Any],
):
    none_now = frozenset(k for k, v in known.items() if v is None)
    for key, value in flatten(table, leaves=none_now).items():
        if key not in known and _is_dict_field(declared.get(key)):  # set now, and no table
            try:
                _as_declared(value, declared[key])
            except ValueError as err:
                raise ValueError(f"{path}: {key} = {err}") from None
        if key not in known or key in _FIXED_KEYS:
            raise _unknown_key_error(key, known, path)
        current = known[key]
        if value is None and type(None) in (_union_members(declared.get(key)) or ()):
            _set(data, key, value)  # JSON null: a field that may be None
            continue
        if current is None:
            try:
                value = _as_declared(value, declared.get(key, Any))
            except ValueError as err:
                raise ValueError(f"{path}: {key} = {err}") from None
        if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if current is not None and type(value) is not type(current) and not (
            isinstance(current, (list, tuple)) and isinstance(value, list)
        ):
            raise ValueError(
                f"{path}: {key} = {value!r} has type {type(value).__name__}, "
                f"expected {type(current).__name__} (like {current!r})"
            )
        if isinstance(current, (list, tuple)):
            try:
                value = _typed_items(value, current, declared.get(key, Any))
            except ValueError as err:
                raise ValueError(f"{path}: {key} = {value!r}: {err}") from None
        _set(data, key, value)


def resolve_config(
    base: JobConfig, *, toml_path: str | Path | None = None, overrides: list[str] = ()
) -> JobConfig:
    """Applies a TOML file and then command-line overrides to a recipe's config.

    Args:
        base: the recipe's config.
        toml_path: optional TOML file whose tables mirror the config sections.
        overrides: ``key=value`` strings with dotted keys, applied in order.

    Returns:
        A new, validated `JobConfig`.
    """
    data = base.to_dict()
    declared = field_types(base)
    known = _settable(data)
    if toml_path is not None:
        path = Path(toml_path)
        is_json = path.suffix.lower() == ".json"
        try:
            text = path.read_text(encoding="utf-8")
            table = json.loads(text) if is_json else tomllib.loads(text)
        except FileNotFoundError:
            raise ValueError(f"config file {path} does not exist") from None
        except (OSError, UnicodeDecodeError) as err:  # a directory, unreadable, not text
            raise ValueError(
                f"config file {path} cannot be read as UTF-8 text ({err}); pass a TOML file"
            ) from None
        except tomllib.TOMLDecodeError as err:
            raise ValueError(f"config file {path} is not valid TOML: {err}") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"config file {path} is not valid JSON: {err}") from None
        if is_json:
            table = _whole_config_json(table, data, declared, path)
            known = _settable(data)
        _merge_toml(data, table, known, str(path), declared)
        known = _settable(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ValueError(f"override {item!r} must look like key=value (e.g. training.lr=1e-3)")
        if key in known:
            current = known[key]
        elif _is_dict_field(declared.get(key)):
            current = _value_at(data, key)  # a dict the recipe sets: replaced whole
        else:
            raise _unknown_key_error(key, known, "the command line")
        value = parse_value(text, current, key, declared.get(key, Any))
        _set(data, key, value)
        known = _settable(data)
    return JobConfig.from_dict(data)


def _whole_config_json(
    table: Any, data: dict[str, Any], declared: dict[str, Any], path: Path
) -> dict[str, Any]:
    """Reads a JSON config file: the nested form ``--print-config`` prints and a run's
    ``config.json`` holds. Its ``model_family`` must be the recipe's; its dict fields
    (``model.rope_scaling``) replace the recipe's whole, as a JSON override does, so the
    printed config passed back gives the same config. Sets those in `data`.

    Returns:
        The rest, to merge key by key as a TOML file's tables are.
    """
    if not isinstance(table, dict):
        raise ValueError(f"config file {path} holds {type(table).__name__}, not a JSON object")
    table = dict(table)
    family = table.pop("model_family", data["model_family"])
    if family != data["model_family"]:
        raise ValueError(
            f"{path} is a config of model family {family!r}, but the recipe's is "
            f"{data['model_family']!r}; start from a {family} recipe (mt-train pretrain "
            "--help lists them)"
        )
    for key in [k for k, t in declared.items() if _is_dict_field(t)]:
        *parents, leaf = key.split(".")
        node = table
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or leaf not in node:
            continue
        try:
            value = _as_declared(node.pop(leaf), declared[key])
        except ValueError as err:
            raise ValueError(f"{path}: {key} = {err}") from None
        _set(data, key, value)
    return table


def _settable(data: dict[str, Any]) -> dict[str, Any]:
    """The keys an override may set now, with their values (every leaf but the fixed ones)."""
    return {k: v for k, v in flatten(data).items() if k not in _FIXED_KEYS}


def _value_at(data: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted key of the nested config dict."""
    node = data
    for part in dotted.split("."):
        node = node[part]
    return node


def _is_dict_field(declared: Any) -> bool:
    """True for a field declared ``dict`` or ``dict | None`` (``model.rope_scaling``)."""
    members = _union_members(declared) or (typing.get_origin(declared) or declared,)
    return dict in members
