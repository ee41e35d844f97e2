"""Key matching for load_full_state_dict, as load_state_dict matches: the model's keys against the checkpoint's,
missing and unexpected keys, strict's errors, and batch norm's num_batches_tracked in older checkpoints."""
from __future__ import annotations

import array
import itertools
from typing import Any, Mapping, NamedTuple, Optional

import torch
import torch.nn as nn

_NBT = "num_batches_tracked"
_DOT_NBT = "." + _NBT
_EXTRA = getattr(nn.modules.module, "_EXTRA_STATE_KEY_SUFFIX", "_extra_state")


def _joined(keys: list) -> Optional[str]:
    """The keys joined by NULs where that splits back into them (every key a string without a NUL); else None.
    Keys compare, hash and cross the wire as one string: a list costs a Python step per key in each comparison
    and in pickling, most of them cache misses on strings made long before."""
    try:
        joined = "\0".join(keys)
    except TypeError:  # a key that is not a string
        return None
    return joined if joined.count("\0") == max(len(keys) - 1, 0) else None


def _keys_and_joined(d: Mapping[str, Any]) -> tuple[list, Optional[str]]:
    keys = list(d)
    return keys, _joined(keys)


class _ModelState(NamedTuple):
    """The model's state_dict() keys and values as lists, made while state_dict() has just touched every one of
    them (later each is a cache miss), and the keys joined (_joined)."""
    keys: list
    joined: Optional[str]
    values: list


_NO_MODEL_STATE = _ModelState([], None, [])


def _model_state(model_sd: Mapping[str, Any]) -> _ModelState:
    keys, joined = _keys_and_joined(model_sd)
    return _ModelState(keys, joined, list(model_sd.values()))


def _same_keys(meta: dict, model_keys: _ModelState) -> bool:
    """Whether the model's keys are the checkpoint's, in its order."""
    theirs, mine = meta.get("keys_joined"), model_keys.joined
    if theirs is not None and mine is not None:
        return theirs == mine  # each splits back into its keys alone, so equal strings are equal keys
    return _checkpoint_keys(meta) == model_keys.keys


def _checkpoint_keys(meta: dict) -> list[str]:
    """The checkpoint's keys (on the wire as one joined string where it can be: _to_wire), split once."""
    if meta["keys"] is None:
        meta["keys"] = meta["keys_joined"].split("\0") if meta["num_keys"] else []
    return meta["keys"]


def _norm_versions(sd: Mapping[str, Any], model_sd: Mapping[str, Any]) -> dict[str, Optional[int]]:
    """Per num_batches_tracked key of the model that the checkpoint lacks, the version that the checkpoint's
    _metadata gives its module (None without one): batch norm's own _load_from_state_dict fills the key in
    for checkpoints older than version 2, so that load_state_dict does not call it missing."""
    lacking = [k for k in model_sd if k.endswith(_NBT) and (k == _NBT or k.endswith(_DOT_NBT)) and k not in sd]
    if not lacking:
        return {}
    md = getattr(sd, "_metadata", None)
    return {k: md.get(k[:-len(_NBT)].rstrip("."), {}).get("version") if md is not None else None for k in lacking}


def _torch_fills(model: nn.Module, key: str, versions: Mapping[str, Optional[int]]) -> bool:
    """A missing key that load_state_dict would not report: batch norm's num_batches_tracked in an old checkpoint."""
    if key not in versions or (versions[key] is not None and versions[key] >= 2):
        return False
    try:
        m = model.get_submodule(key[:-len(_NBT)].rstrip("."))
    except AttributeError:
        return False
    return isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats


def _under_none_children(model: nn.Module) -> tuple[str, ...]:
    """Prefixes of children set to None: load_state_dict passes over checkpoint keys under them."""
    out = []
    for name, m in model.named_modules(remove_duplicate=False):
        out += [f"{name}.{c}." if name else f"{c}." for c, child in m._modules.items() if child is None]
    return tuple(out)


def _strict_errors(missing: list[str], unexpected: list[str]) -> list[str]:
    out = []
    if missing:
        out.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        out.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    return out


def _key_editing_hooks(model: nn.Module) -> bool:
    """Whether a load_state_dict post-hook that may edit the missing or unexpected keys is registered:
    any but FSDP's own, which re-pad shards and leave the keys alone."""
    return any(not (getattr(hook, "__module__", None) or "").startswith("torch.distributed.fsdp")
               for m in model.modules() for hook in m._load_state_dict_post_hooks.values())


def _match_keys(plan: Any, model: nn.Module, model_sd: Mapping[str, Any], model_keys: _ModelState,
                extra: Mapping[str, nn.Module], meta: dict, strict: bool,
                rank: int) -> tuple[list[str], list, torch.Tensor, list[str], Mapping]:
    """Key matching, as load_state_dict matches: the keys loaded, their values, each one's table row (int64),
    the keys worded in errors, and the extra-state modules that take a value. Missing, unexpected and
    refused keys go to `plan` (a _load_plan._Plan)."""
    if not extra and not meta["bad"] and _in_checkpoint_order(meta, model_sd, model_keys):
        # The usual case: nothing to match key by key.
        return model_keys.keys, model_keys.values, meta["rows"], model_keys.keys, extra
    if extra:  # load_state_dict takes extra state only into modules that override set_extra_state
        unset = {k for k, m in extra.items() if type(m).set_extra_state is nn.Module.set_extra_state}
        if unset:
            model_sd = {k: v for k, v in model_sd.items() if k not in unset}
            extra = {k: m for k, m in extra.items() if k not in unset}
    # The usual case (no value an extra state or refused) in one pass over the keys (_usual_match), cheaper per
    # key than the loop of _match_each.
    usual = _usual_match(meta, model_sd) if not extra and not meta["bad"] else None
    _missing_and_unexpected(plan, model, model_sd, meta, usual, strict)
    # Key matching here; per value, its checks, unit and box in C++ (csrc/load_dests.h).
    if usual is not None and usual.rows is not None:  # else a source value is extra state: the loop words it
        values = list(model_sd.values()) if len(usual.keys) == len(model_sd) else [model_sd[k] for k in usual.keys]
        return usual.keys, values, usual.rows, usual.keys, extra
    return _match_each(plan, model_sd, extra, meta, rank)


def _missing_and_unexpected(plan: Any, model: nn.Module, model_sd: Mapping[str, Any], meta: dict,
                            usual: Optional[_UsualMatch], strict: bool) -> None:
    """plan.missing and plan.unexpected as load_state_dict finds them, and strict's errors, or that strict is
    judged after the post-hooks (which may clear them)."""
    index, _ = _key_index(meta)
    keys = _checkpoint_keys(meta)
    plan.missing = usual.missing if usual is not None else [k for k in model_sd if k not in index]
    if plan.missing and meta.get("norm_versions"):
        plan.missing = [k for k in plan.missing if not _torch_fills(model, k, meta["norm_versions"])]
    # Every checkpoint key matched (keys are unique on both sides): none is unexpected.
    every = usual is not None and len(usual.keys) == len(keys)
    plan.unexpected = [] if every else [k for k in keys if k not in model_sd]
    if plan.unexpected:
        under_none = _under_none_children(model)
        if under_none:
            plan.unexpected = [k for k in plan.unexpected if not k.startswith(under_none)]
    if strict and (plan.missing or plan.unexpected) and _key_editing_hooks(model):
        plan.strict_after_hooks = True  # as load_state_dict: the hooks may clear them
    elif strict:
        plan.errors += _strict_errors(plan.missing, plan.unexpected)


def _match_each(plan: Any, model_sd: Mapping[str, Any], extra: Mapping[str, nn.Module], meta: dict,
                rank: int) -> tuple[list[str], list, torch.Tensor, list[str], Mapping]:
    """_match_keys key by key, where some value is an extra state or refused: those go to plan.extras and
    plan.errors."""
    extras, bad = meta["extras"], meta["bad"]
    index, row_of = _key_index(meta)
    load_keys, values, value_rows, value_keys = [], [], [], []
    for k, v in model_sd.items():
        i = index.get(k)
        if i is None:
            continue
        load_keys.append(k)
        if k in extra:
            if i not in extras:
                plan.errors.append(f'"{k}": extra state on rank {rank}, but not on the source (models differ)')
            else:
                plan.extras.append((extras[i], extra[k]))
            continue
        if i in bad:
            plan.errors.append(f'While copying the parameter named "{k}", the source\'s value is {bad[i]}.')
            continue
        j = i if row_of is None else row_of.get(i)
        if j is None:
            plan.errors.append(f'"{k}": extra state on the source, but a tensor on rank {rank} (models differ)')
            continue
        values.append(v)
        value_rows.append(j)
        value_keys.append(k)
    return load_keys, values, torch.tensor(value_rows, dtype=torch.int64), value_keys, extra


def _in_checkpoint_order(meta: dict, model_sd: Mapping[str, Any], model_keys: _ModelState) -> bool:
    """Whether the model's keys are the checkpoint's, in its order, each value a tensor of its own table row
    (rows is then 0..n-1)."""
    return meta["rows"].numel() == meta["num_keys"] == len(model_sd) and _same_keys(meta, model_keys)


def _key_index(meta: dict) -> tuple[dict[str, int], Optional[dict[int, int]]]:
    """The checkpoint's key -> key index, and key index -> table row (None where each key is the row of its
    index: no value is an extra state or refused); made once per load (meta keeps them)."""
    found = meta.get("_index")
    if found is None:
        keys = _checkpoint_keys(meta)
        index = dict(zip(keys, range(len(keys))))
        rows = meta["rows"]
        every = rows.numel() == meta["num_keys"]  # (then rows is 0..n-1: _describe_source)
        found = meta["_index"] = index, None if every else dict(zip(rows.tolist(), range(rows.numel())))
    return found


class _UsualMatch(NamedTuple):
    keys: list  # the model's keys found in the checkpoint, in the model's order
    rows: Optional[torch.Tensor]  # their table rows (int64); None where a key's value is an extra state
    missing: list  # the model's keys not in the checkpoint


def _usual_match(meta: dict, model_sd: Mapping[str, Any]) -> _UsualMatch:
    """Key matching where no value is an extra state nor refused, in one pass over the model's keys. Made once
    per load and model state: the source's prepack matches before its plan does."""
    found = meta.get("_usual")
    if found is not None and found[0] is model_sd:
        return found[1]
    index, row_of = _key_index(meta)
    keys = list(model_sd)
    # map into an array: no bytecode per key, which a list comprehension runs
    at = array.array("q", map(index.get, keys, itertools.repeat(-1, len(keys))))
    if row_of is not None:  # -2: a key whose value has no table row (an extra state)
        at = array.array("q", [-1 if i < 0 else row_of.get(i, -2) for i in at])
    rows = torch.frombuffer(at, dtype=torch.int64) if at else torch.empty(0, dtype=torch.int64)
    if at and bool((rows >= 0).all()):
        match = _UsualMatch(keys, rows, [])
    else:
        found_at = (rows != -1).tolist()
        missing = list(itertools.compress(keys, [not f for f in found_at]))
        rows = rows[rows != -1]
        match = _UsualMatch(list(itertools.compress(keys, found_at)), None if bool((rows < 0).any()) else rows,
                            missing)
    meta["_usual"] = model_sd, match
    return match
