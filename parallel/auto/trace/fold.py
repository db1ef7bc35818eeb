"""Data-dependent reads during tracing: folded when the value is a constant, else one clear error.

The planner traces on fake tensors, which have shapes but no values. Models read values in
Python: `bool(tensor)`, `.item()`, `.tolist()`, `torch.equal` (torch.nn.Transformer checks
whether a `tgt_mask` is causal this way). Such a read ends a fake trace with torch's
DataDependentOutputException. `ConstantReads` is a TorchFunctionMode around the trace that
keeps, beside every tensor built from constants only (factory ops, plain tensor attributes of
the model, ops on those), its real value ("shadow"), computed with every tracing mode off.
A read of such a tensor returns the real Python value and leaves the graph (the value is
the same on every rank and every step); each fold is recorded (`FoldedRead`) for the
coverage report. A read of a value that depends on the inputs or the parameters cannot be
planned: it raises `DataDependentError` naming the op, the module and the source line.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.weak import WeakIdKeyDictionary

from parallel import _torch as T

# reads that turn a tensor's value into a Python value (a fake tensor has none)
_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.equal, torch.Tensor.equal,
          torch.allclose, torch.Tensor.allclose, torch.is_nonzero, torch.Tensor.is_nonzero}
# random draws differ per call: never shadowed (a read of one is an error, not a fold)
_RANDOM = ("rand", "normal", "bernoulli", "dropout", "multinomial", "poisson", "uniform", "exponential",
           "geometric", "cauchy")
_MODULE_PY = inspect.getsourcefile(nn.Module)  # its __call__ wrappers are not the model's code
SHADOW_LIMIT = 1 << 24
"""Largest constant (elements) whose real value is kept: 64 MiB in fp32; bigger ones (a
causal mask at a long sequence) are traced as usual and a read of them is an error."""


class DataDependentError(ValueError):
    """The model reads a value that depends on its inputs or parameters while tracing."""


@dataclass(frozen=True)
class FoldedRead:
    """One data-dependent read of a constant, replaced by its value at trace time."""

    op: str  # the torch function, e.g. "Tensor.item"
    module: str  # FQN of the innermost module whose forward made the read ("" = the root)
    where: str  # file:line of that forward's frame
    value: str  # repr of the value (shortened)


def _name(func: Any) -> str:
    qual = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    return qual if qual.startswith("Tensor.") or "." in qual else f"torch.{qual}"


_INPLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or",
                                              "xor", "lshift", "rshift", "matmul")} | {"__setitem__"}


def _mutated(func: Any, kwargs: dict, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors a call changes in place: `out=` tensors, else the first tensor of an in-place
    method (`masked_fill_`, `__setitem__`, `__iadd__`)."""
    if "out" in kwargs:
        return [t for t in T.tree_flatten(kwargs["out"])[0] if isinstance(t, torch.Tensor)]
    name = getattr(func, "__name__", "")
    inplace = name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))
    return tensors[:1] if inplace else []


class ConstantReads(TorchFunctionMode):
    """Shadow real values of constants; fold reads of them, report reads of data (module doc)."""

    def __init__(self, model: nn.Module, prefix: str = "") -> None:
        super().__init__()
        self.shadow: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.modules = {id(m): (prefix + fqn).rstrip(".") for fqn, m in model.named_modules()}
        self.folded: list[FoldedRead] = []

    def real(self, t: torch.Tensor) -> torch.Tensor | None:
        """The real value of `t`: itself for a plain tensor (a constant of the model), else its shadow."""
        if type(t) is torch.Tensor and not T.is_fake(t) and t.device.type != "meta":
            return t
        return self.shadow.get(t)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, spec = T.tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        reals = [self.real(x) for x in tensors]
        known = all(r is not None for r in reals) and not any(w in getattr(func, "__name__", "") for w in _RANDOM)
        if func in _READS and known and tensors:
            value = self._run_real(func, leaves, spec, reals)
            self.folded.append(FoldedRead(_name(func), *self._where(), repr(value)[:60]))
            return value
        try:
            out = func(*args, **kwargs)
        except (T.DataDependentOutputException, T.DynamicOutputShapeException) as e:
            raise self._error(func, e) from None
        for t in _mutated(func, kwargs, tensors):
            self._forget(t)
        if known:
            self._shadow_outputs(out, func, leaves, spec, reals)
        return out

    def _run_real(self, func: Any, leaves: list, spec: Any, reals: list) -> Any:
        it = iter(reals)
        args, kwargs = T.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in leaves], spec)
        with T.real_tensors(), torch.no_grad():
            return func(*args, **kwargs)

    def _shadow_outputs(self, out: Any, func: Any, leaves: list, spec: Any, reals: list) -> None:
        outs = [o for o in T.tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if not outs or any(o.numel() > SHADOW_LIMIT for o in outs):
            return
        real_out = self._run_real(func, leaves, spec, reals)
        for o, r in zip(outs, [r for r in T.tree_flatten(real_out)[0] if isinstance(r, torch.Tensor)]):
            self.shadow[o] = r

    def _forget(self, t: torch.Tensor) -> None:
        """A tensor was changed in place by an op not shadowed: drop its value and every
        shadow sharing its storage (views of it)."""
        r = self.shadow.pop(t, None)
        if r is None:
            return
        ptr = r.untyped_storage().data_ptr()
        for k in [k for k, v in self.shadow.items() if v.untyped_storage().data_ptr() == ptr]:
            self.shadow.pop(k, None)

    def _where(self) -> tuple[str, str]:
        """(module FQN, file:line) of the innermost frame that is a forward of one of the model's modules."""
        f = inspect.currentframe()
        while f is not None:
            code = f.f_code
            mod = f.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
            if isinstance(mod, nn.Module) and id(mod) in self.modules and code.co_filename != _MODULE_PY:
                return self.modules[id(mod)], f"{os.path.basename(code.co_filename)}:{f.f_lineno}"
            f = f.f_back
        return "", "?"

    def _error(self, func: Any, e: Exception) -> DataDependentError:
        module, where = self._where()
        op = getattr(e, "func", None)
        return DataDependentError(
            f"{_name(func)} ({op}) in module '{module or '(root)'}' at {where} needs the value of a tensor computed "
            "from the model's inputs or parameters; the planner traces on fake tensors, which have no values. "
            "Fix: compute it from constants only (then it is folded at trace time), pass it as a Python value, "
            "or avoid the read (e.g. torch.nn.Transformer: pass tgt_is_causal / is_causal explicitly)")
