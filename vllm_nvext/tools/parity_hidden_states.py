"""The hidden-states verdict of `vllm-nvext parity --hidden-states`: both dialects' files load and match.

Pure like `parity_checks`: the loader is passed in (`vllm_nvext.hidden_states.load`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..client import TokenIds
from .parity_checks import FAIL, NVEXT_DIALECT, PASS, SKIP, VLLM_DIALECT, Case, Row


def judge_hidden_states(
    case: Case,
    vllm_ids: TokenIds | None,
    nvext_ids: TokenIds | None,
    load: Callable[..., Any],
    atol: float,
) -> tuple[list[Row], dict[str, Any] | None]:
    """Rows for both answers' hidden-state files, and their report entry (None when not loaded).

    `load(path, expect_token_ids=...)` is `vllm_nvext.hidden_states.load` (it raises when the
    file does not hold the prompt ids); the tensors it returns are compared within `atol`.
    """
    loaded: dict[str, Any] = {}
    problems = []
    for name, ids in ((VLLM_DIALECT, vllm_ids), (NVEXT_DIALECT, nvext_ids)):
        if ids is None:
            continue
        params = ids.kv_transfer_params or {}
        path = params.get("hidden_states_path")
        if not path:
            error = params.get("hidden_states_error")  # the connector refused this request's capture
            problems.append(
                f"{name}: {error}"
                if error
                else f"{name}: no kv_transfer_params.hidden_states_path (is a hidden-states connector configured?)"
            )
            continue
        try:
            loaded[name] = load(path, expect_token_ids=ids.prompt_token_ids)
        except Exception as exc:  # HiddenStatesError, or anything torch raises
            problems.append(f"{name}: {exc}")
    if vllm_ids is None or nvext_ids is None:
        return [Row(case.label, "hidden states load", SKIP, "a request failed (see above)")], None
    if problems:
        return [Row(case.label, "hidden states load", FAIL, "; ".join(problems))], None
    shapes = {name: list(hs.hidden_states.shape) for name, hs in loaded.items()}
    report: dict[str, Any] = {name: {"path": hs.path, "shape": shapes[name]} for name, hs in loaded.items()}
    rows = [Row(case.label, "hidden states load", PASS, f"shape {shapes[VLLM_DIALECT]}, ids == prompt ids")]
    a, b = loaded[VLLM_DIALECT].hidden_states, loaded[NVEXT_DIALECT].hidden_states
    if shapes[VLLM_DIALECT] != shapes[NVEXT_DIALECT]:
        detail = f"shapes {shapes[VLLM_DIALECT]} != {shapes[NVEXT_DIALECT]}"
        rows.append(Row(case.label, "hidden states equal", FAIL, detail))
        return rows, report
    max_diff = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    report["max_abs_diff"] = max_diff
    status = PASS if max_diff <= atol else FAIL
    rows.append(Row(case.label, "hidden states equal", status, f"max abs diff {max_diff:.3g} (atol {atol:g})"))
    return rows, report
