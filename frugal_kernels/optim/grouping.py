"""Splitting a model's parameters into projected and regular groups, as FRUGAL does."""

from __future__ import annotations

import warnings
from typing import Iterable, List, Optional

from torch import nn

__all__ = ["param_groups", "DEFAULT_PATTERNS"]

# Module-name fragments of the attention and MLP matrices of common model
# families; a 2-D weight whose module name contains one is projected.
DEFAULT_PATTERNS = (
    # Llama / Mistral / Qwen (Hugging Face) and frugal_kernels.model
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    # GPT-2 (Conv1D modules with 2-D weights)
    "attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj",
    # BERT / RoBERTa
    "attention.self.query", "attention.self.key", "attention.self.value",
    "attention.output.dense", "intermediate.dense", "output.dense",
)
_EMBEDDING_HINTS = ("embed", "wte", "wpe", "word_embeddings", "position_embeddings")
_HEAD_HINTS = ("lm_head", "output_projection", "classifier")


def param_groups(
    model: nn.Module,
    *,
    patterns: Optional[Iterable[str]] = None,
    extra_patterns: Iterable[str] = (),
    project_embeddings: bool = False,
    project_head: bool = False,
    project_norms: bool = False,
    **projected_options,
) -> List[dict]:
    """Split ``model``'s trainable parameters the way the FRUGAL paper does.

    Projected: the 2-D weights of attention and MLP modules, found by module
    name (``patterns``, default :data:`DEFAULT_PATTERNS`: Hugging Face Llama,
    GPT-2, BERT/RoBERTa and ``frugal_kernels.model``; add your own with
    ``extra_patterns``). Regular (full AdamW): embeddings, norms, the output
    head and biases, unless ``project_embeddings`` / ``project_head`` /
    ``project_norms`` move them to the projected group.

    ``projected_options`` (e.g. ``density=0.25``) are set on the projected
    group. Returns ``[{"params": regular, "projected": False},
    {"params": projected, "projected": True, **projected_options}]``, empty
    groups left out.

    When no parameter is projected although the model has matrices that could
    be (2-D weights outside embeddings, norms and head: a model whose names no
    pattern knows, such as a plain ``nn.Sequential``), one warning names them
    and says how to project them (``extra_patterns``): FRUGAL would otherwise
    hold exactly AdamW's state.
    """
    patterns = tuple(patterns if patterns is not None else DEFAULT_PATTERNS) + tuple(extra_patterns)
    projected, regular, seen = [], [], set()
    unmatched = []  # names of the 2-D weights no pattern matched
    for module_name, module in model.named_modules():
        for param_name, p in module.named_parameters(recurse=False):
            if id(p) in seen or not p.requires_grad:
                continue
            seen.add(id(p))
            if _is_projected(module, module_name, param_name, p, patterns, project_embeddings,
                             project_head, project_norms):
                projected.append(p)
            else:
                regular.append(p)
                if _is_projected(module, module_name, param_name, p, ("",), False, False,
                                 False):
                    unmatched.append(f"{module_name}.{param_name}" if module_name
                                     else param_name)
    if not projected and unmatched:
        _warn_nothing_projected(unmatched)
    groups = []
    if regular:
        groups.append({"params": regular, "projected": False})
    if projected:
        groups.append({"params": projected, "projected": True, **projected_options})
    return groups


def _warn_nothing_projected(unmatched: List[str]) -> None:
    shown = ", ".join(unmatched[:6]) + (f" and {len(unmatched) - 6} more"
                                         if len(unmatched) > 6 else "")
    module = unmatched[0].rsplit(".", 1)[0]
    warnings.warn(
        f"param_groups projected nothing: no module name matched a known pattern "
        f"(frugal_kernels.optim.grouping.DEFAULT_PATTERNS: Llama, GPT-2, BERT names), so "
        f"FRUGAL would keep full AdamW state for every parameter. Matrices seen: {shown}. "
        f"Name the ones to project with extra_patterns=[...] (fragments of their module "
        f"names, e.g. param_groups(model, extra_patterns=[{module!r}])); docs/optimizers.md, "
        f"\"Which parameters are projected\"", UserWarning, stacklevel=3)


def _is_projected(module, module_name, param_name, p, patterns, project_embeddings, project_head,
                  project_norms) -> bool:
    lowered = module_name.lower()
    if isinstance(module, nn.Embedding) or any(h in lowered for h in _EMBEDDING_HINTS):
        return project_embeddings
    if any(h in lowered for h in _HEAD_HINTS):
        return project_head
    if "norm" in lowered or "ln_" in lowered or isinstance(module, (nn.LayerNorm,)):
        return project_norms
    if param_name != "weight" or p.dim() != 2:
        return False  # biases and other vectors stay regular
    return any(pattern in module_name for pattern in patterns)
