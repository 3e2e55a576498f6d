"""One declaration per op, and everything that is made from it.

An op is declared once, as an :class:`OpSpec`: its arguments in the order of its
schema (the lists of tensors it updates or reads, the per-call settings such as a
subset kind, and the hyper-parameters with their types, defaults and checks), the
metadata check that no argument can make alone, and one implementation per backend
that the capability table (:data:`frugal_kernels.ops._dispatch.CAPABILITIES`) lists
for it (the ``torch`` and ``triton`` ones are the reference function and the Triton
launcher of the op's name unless the module declares others). From it come:

- the hyper-parameter record (a :class:`~frugal_kernels.ops._common.Hyper` subclass,
  named as its struct in ``_C``) and the ``Tensors`` record the backends take;
- the registered ``torch.library`` op and its fake kernel (the checks, which read
  metadata only);
- the public function (``frugal_kernels.ops.<op>``), which converts Python numbers
  and calls the registered op;
- the unchecked call (:meth:`OpSpec.unchecked`): the op's body without the metadata
  checks and torch.library's dispatch, for callers that checked the same call once
  and repeat it, as the optimizers' plans do;
- the prepared call (:meth:`OpSpec.prepare`, :mod:`frugal_kernels.ops.prepared`):
  the op over fixed tensors, called with new gradients and scalars.

A new hyper-parameter is then one :class:`Arg` here, a field of the ``_C`` struct
and the math of each backend.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from frugal_kernels import reference
from frugal_kernels.ops import _dispatch
from frugal_kernels.ops._common import (Hyper, Scalar, as_scalar_tensor, check_amp,
                                        check_no_overlap, check_scalars, skipped_on_host)
from frugal_kernels.ops.prepared import Call, PreparedCall

__all__ = ["REQUIRED", "Arg", "Implementations", "OpSpec", "amp", "choice", "flag", "finite",
           "ints", "integer", "non_negative", "real", "rule", "scalar", "tensors", "text",
           "unit_interval"]

# The default of an argument that has none.
REQUIRED = _REQUIRED = inspect.Parameter.empty


@dataclasses.dataclass(frozen=True)
class Arg:
    """One argument of an op, in schema order.

    ``role`` is ``"list"`` (a list of tensors, or of ints, in the backends' ``Tensors``
    record), ``"setting"`` (a per-call value in the ``Tensors`` record, such as the
    subset kind) or ``"hyper"`` (a field of the hyper-parameter record and of its
    ``_C`` struct). ``keyword``: keyword-only in the public function, and passed by
    keyword to the Triton and reference functions. ``public``: how the public function
    converts a user's value; ``fast``: how an unchecked or prepared call converts a
    caller's (cheaper: those callers pass tensors for ``lr`` and ``step``). ``check``
    runs on the converted value, before anything is written."""

    name: str
    annotation: Any
    role: str
    default: Any = _REQUIRED
    keyword: bool = False
    written: bool = False
    contiguous: bool = False   # a read-only list the op hands its backends contiguous
    public: Optional[Callable[[str, str, Any], Any]] = None
    fast: Optional[Callable[[Any], Any]] = None
    check: Optional[Callable[[str, str, Any], None]] = None


# ------------------------------------------------------------------ value checks

def finite(op: str, name: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{op}: {name} must be finite, got {value}")


def unit_interval(op: str, name: str, value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise ValueError(f"{op}: {name} must be in [0, 1), got {value}")


def non_negative(op: str, name: str, value: float) -> None:
    if not value >= 0.0:
        raise ValueError(f"{op}: {name} must be >= 0, got {value}")


def choice(values: Sequence[str]) -> Callable[[str, str, str], None]:
    def check(op: str, name: str, value: str) -> None:
        if value not in values:
            raise ValueError(f"{op}: {name} must be one of {', '.join(values)}; got {value!r}")
    return check


# ------------------------------------------------------------ argument builders

def _float(op: str, name: str, value: Any) -> float:
    return float(value)


def _int(op: str, name: str, value: Any) -> int:
    return int(value)


def _bool(op: str, name: str, value: Any) -> bool:
    return bool(value)


def _same(op: str, name: str, value: Any) -> Any:
    return value


def _list(op: str, name: str, value: Any) -> list:
    return list(value)


def _int_list(op: str, name: str, value: Any) -> List[int]:
    return [int(v) for v in value]


def _scalar_tensor(value: Tensor) -> Tensor:
    return value.reshape(())


def tensors(name: str, *, written: bool = False, contiguous: bool = False) -> Arg:
    """A list of tensors, one per tensor the call updates."""
    return Arg(name, List[Tensor], "list", written=written, contiguous=contiguous,
               public=_list, fast=list)


def ints(name: str, *, keyword: bool = False) -> Arg:
    """A list of ints, one per tensor (a side, a seed)."""
    return Arg(name, List[int], "list", keyword=keyword, public=_int_list,
               fast=lambda v: [int(x) for x in v])


def text(name: str, values: Sequence[str]) -> Arg:
    """A per-call setting among ``values`` (keyword-only)."""
    return Arg(name, str, "setting", keyword=True, public=_same, fast=str, check=choice(values))


def scalar(name: str) -> Arg:
    """``lr`` or ``step``: a number or a one-element tensor, taken as a 0-dim tensor
    (a device tensor is read on the device by the GPU backends; its value checks run
    where it lives on the host, :func:`~frugal_kernels.ops._common.check_scalars`)."""
    return Arg(name, Tensor, "hyper", keyword=True, public=as_scalar_tensor,
               fast=_scalar_tensor)


def real(name: str, default: Any = _REQUIRED, check=finite) -> Arg:
    return Arg(name, float, "hyper", default, keyword=True, public=_float, fast=float,
               check=check)


def flag(name: str, default: Any = _REQUIRED) -> Arg:
    return Arg(name, bool, "hyper", default, keyword=True, public=_bool, fast=bool)


def integer(name: str, default: Any = _REQUIRED, check=None) -> Arg:
    return Arg(name, int, "hyper", default, keyword=True, public=_int, fast=int, check=check)


def rule(name: str, values: Sequence[str], default: Any = _REQUIRED) -> Arg:
    """A hyper-parameter among ``values`` (the ``_C`` struct takes its code)."""
    return Arg(name, str, "hyper", default, keyword=True, public=_same, fast=str,
               check=choice(values))


def amp() -> Tuple[Arg, Arg]:
    """GradScaler's tensors: the gradients are divided by ``grad_scale`` as they are
    read, and a non-zero ``found_inf`` leaves every tensor untouched."""
    return tuple(Arg(name, Optional[Tensor], "hyper", None, keyword=True, public=_same,
                     fast=None) for name in ("grad_scale", "found_inf"))


# ------------------------------------------------------------------ the spec

class Implementations(dict):
    """An op's backends by name, declared one by one with :meth:`backend` and held to
    the capability table by :meth:`complete` (the out-of-place ops, ``dequantize`` and
    ``quant_matmul``, have these without a whole :class:`OpSpec`)."""

    def __init__(self, op: str):
        super().__init__()
        self.op = op

    def backend(self, name: str) -> Callable:
        def register(impl: Callable) -> Callable:
            self[name] = impl
            return impl
        return register

    def complete(self) -> "Implementations":
        """Refuse a set of backends that is not the capability table's for the op."""
        listed = _dispatch.CAPABILITIES[self.op]
        if set(self) != set(listed):
            raise AssertionError(f"{self.op}: implemented on {sorted(self)} but the "
                                 f"capability table lists {sorted(listed)}")
        return self


Impl = Callable[[NamedTuple, Hyper], None]


class OpSpec:
    """The declaration of one op (see the module docstring).

    Args:
        name: the op's name at every layer (``frugal::<name>``, ``ops.<name>``).
        args: its arguments in schema order (the builders of this module).
        record: the name of its hyper-parameter record and ``_C`` struct, or the record
            of another op whose fields are the same.
        check: the metadata checks no argument makes alone (lengths, dtypes, shapes,
            devices), ``check(op, a)`` with ``a`` the arguments by name; runs after the
            arguments' own checks, in the registered op and in its fake kernel.
        lead: the list whose first tensor gives the device, and whose empty tensors
            are left out of the call when ``skip_empty``.
        validate: the data checks of the public function (a device sync on GPUs),
            ``validate(op, a)``, run when the caller passes ``check_indices=True``.
        ext: how the op module looks up ``_C`` (tests replace it there).
    """

    def __init__(self, name: str, args: Sequence[Arg], *, record: Any,
                 check: Callable[[str, Any], None], lead: str = "params",
                 skip_empty: bool = False,
                 validate: Optional[Callable[[str, Any], None]] = None,
                 ext: Callable[[], Any]):
        self.name, self.op = name, f"frugal::{name}"
        self.args = tuple(args)
        self._check_op, self._validate, self.ext = check, validate, ext
        self.lead, self.skip_empty = lead, skip_empty
        self.written = tuple(a.name for a in self.args if a.written)
        self.by_name = {a.name: a for a in self.args}
        self.hyper = tuple(a for a in self.args if a.role == "hyper")
        listed = [a for a in self.args if a.role != "hyper"]
        self.Tensors = NamedTuple("Tensors", [(a.name, a.annotation) for a in listed])
        self._lists = tuple(a.name for a in listed if a.role == "list")
        self._positional = tuple(a.name for a in listed if not a.keyword)
        self._keywords = tuple(a.name for a in listed if a.keyword)
        self._contiguous = tuple(a.name for a in listed if a.contiguous)
        self._checked = tuple(a for a in self.args if a.check is not None)
        fields = [(a.name, a.annotation) for a in self.hyper]
        if isinstance(record, str):
            record = dataclasses.make_dataclass(record, fields, bases=(Hyper,), frozen=True)
        elif [(f.name, f.type) for f in dataclasses.fields(record)] != fields:
            raise TypeError(f"{self.op}: the record {record.__name__} has other fields")
        self.Hyper = record
        self._fast = tuple((a.name, a.fast, a.default) for a in self.hyper)
        self._Args = NamedTuple("Args", [(a.name, a.annotation) for a in self.args])
        self.impls = Implementations(self.op)
        self.prepares: Dict[str, Callable[[Any, NamedTuple], Call]] = {}
        self.registered: Any = None

    # ---------------------------------------------------------- backends

    def backend(self, name: str) -> Callable[[Impl], Impl]:
        """Decorator: ``impl(tensors, hyper)``, the op's ``name`` backend."""
        return self.impls.backend(name)

    def prepared(self, name: str) -> Callable:
        """Decorator: ``prepare(ext, tensors)`` (the gradients left out), the launch of
        the ``name`` backend's kernel over tensors gathered once; the registered op
        gathers and launches at once."""
        def register(prepare: Callable[[Any, NamedTuple], Call]) -> Callable:
            self.prepares[name] = prepare

            def impl(t: NamedTuple, h: Hyper) -> None:
                prepare(self.ext(), t)([g.data_ptr() for g in t.grads], h)
            self.impls[name] = impl
            return prepare
        return register

    def call(self, fn: Callable, t: NamedTuple, hyper: Dict[str, Any]) -> Any:
        """``fn`` (a Triton launcher or the reference) on the tensors and ``hyper``: the
        lists positionally, the settings and hyper-parameters by keyword."""
        return fn(*(getattr(t, n) for n in self._positional),
                  **{n: getattr(t, n) for n in self._keywords}, **hyper)

    # ---------------------------------------------------------- checks and body

    def check(self, *values: Any) -> None:
        """Every metadata check, with the registered op's signature (the fake kernel)."""
        a = self._Args(*values[:len(self.args)])
        if "grad_scale" in self.by_name:
            check_amp(self.op, a.grad_scale, a.found_inf)
        for arg in self._checked:
            arg.check(self.op, arg.name, getattr(a, arg.name))
        self._check_op(self.op, a)

    def _split(self, values: Sequence[Any]) -> Tuple[NamedTuple, Hyper]:
        a = self._Args(*values)
        return (self.Tensors(*(getattr(a, n) for n in self.Tensors._fields)),
                self.Hyper(*(getattr(a, h.name) for h in self.hyper)))

    def apply(self, t: NamedTuple, h: Hyper, backend: str) -> None:
        """The op's body after its metadata checks: the scalar checks that need no
        device sync, the GradScaler skip decided on the host, then the backend."""
        check_scalars(self.op, h.lr, getattr(h, "step", None))
        if "found_inf" in self.by_name and skipped_on_host(h.found_inf):
            return
        lead = getattr(t, self.lead)
        if self.skip_empty:
            keep = [i for i, x in enumerate(lead) if x.numel() > 0]
            if len(keep) < len(lead):
                t = self.Tensors(*([v[i] for i in keep] if n in self._lists else v
                                   for n, v in zip(t._fields, t)))
                lead = getattr(t, self.lead)
        if not lead:
            return
        impl = self.impls[_dispatch.resolve(backend, lead[0].device, self.op)]
        impl(self._contiguous_reads(t), h)

    def _contiguous_reads(self, t: NamedTuple) -> NamedTuple:
        return t._replace(**{n: [x.contiguous() for x in getattr(t, n)]
                             for n in self._contiguous})

    # ---------------------------------------------------------- what is made

    def _standard_backends(self) -> None:
        """The two backends every in-place op has alike, where the capability table lists
        them and the op's module declared no other: ``torch``, the readable reference
        ``frugal_kernels.reference.<name>`` on host hyper-parameters, and ``triton``, the
        launcher ``<name>`` of ``frugal_kernels.kernels.triton.<name without its _>``,
        imported at its first call (Triton is an optional dependency)."""
        listed = _dispatch.CAPABILITIES[self.op]
        if "torch" in listed and "torch" not in self.impls:
            math_fn = getattr(reference, self.name)
            self.impls["torch"] = lambda t, h: self.call(math_fn, t, h.on_host())
        if "triton" in listed and "triton" not in self.impls:
            module = f"frugal_kernels.kernels.triton.{self.name.rstrip('_')}"

            def triton(t: NamedTuple, h: Hyper) -> None:
                self.call(getattr(importlib.import_module(module), self.name), t, h.values())
            self.impls["triton"] = triton

    def register(self, doc: str) -> Callable:
        """Register the op and its fake kernel; return the public function (``doc`` its
        docstring). Adds the standard ``torch`` and ``triton`` backends the module did not
        declare, then refuses a spec whose backends are not those of the capability
        table."""
        self._standard_backends()
        self.impls.complete()
        params = [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    annotation=a.annotation) for a in self.args]
        params.append(inspect.Parameter("backend", inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                        annotation=str))
        reads = {a.name: a for a in self.args if a.role == "list"
                 and a.annotation == List[Tensor] and not a.written}
        written = [a.name for a in self.args if a.written]
        signature = inspect.Signature(params, return_annotation=None)

        def body(*values: Any) -> None:
            self.check(*values)
            a = self._Args(*values[:-1])
            check_no_overlap(self.op, written={n: getattr(a, n) for n in written},
                             read={n: getattr(a, n) for n in reads})
            t, h = self._split(values[:-1])
            self.apply(t, h, values[-1])

        def fake(*values: Any) -> None:
            self.check(*values)

        for fn in (body, fake):
            fn.__signature__ = signature
            fn.__name__ = f"_{self.name}_op"
        self.registered = torch.library.custom_op(self.op, mutates_args=written)(body)
        self.registered.register_fake(fake)
        return self._public(doc)

    def _public(self, doc: str) -> Callable:
        op, args, registered = self.op, self.args, self.registered
        validate = self._validate

        def public(*positional: Any, **kwargs: Any) -> None:
            bound = signature.bind(*positional, **kwargs)
            bound.apply_defaults()
            given = bound.arguments
            if "grad_scale" in given:
                check_amp(op, given["grad_scale"], given["found_inf"])
            values = [a.public(op, a.name, given[a.name]) for a in args]
            backend = given["backend"]
            if validate is not None and given["check_indices"]:
                self.check(*values, backend)
                validate(op, self._Args(*values))
            registered(*values, backend)

        params = [inspect.Parameter(a.name, inspect.Parameter.KEYWORD_ONLY if a.keyword
                                    else inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                    default=a.default,
                                    annotation=Scalar if a.public is as_scalar_tensor
                                    else a.annotation)
                  for a in args]
        positional = [p for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
        # Keyword-only arguments without a default first, as the faces have them.
        keyword = sorted((p for p in params if p.kind is p.KEYWORD_ONLY),
                         key=lambda p: p.default is not _REQUIRED)
        keyword.append(inspect.Parameter("backend", inspect.Parameter.KEYWORD_ONLY,
                                         default="auto", annotation=str))
        if validate is not None:
            keyword.append(inspect.Parameter("check_indices", inspect.Parameter.KEYWORD_ONLY,
                                             default=True, annotation=bool))
        signature = inspect.Signature(positional + keyword, return_annotation=None)
        public.__signature__ = signature
        public.__name__ = public.__qualname__ = self.name
        public.__doc__ = doc
        public.__module__ = "frugal_kernels.ops"
        return public

    def hyper_from(self, kwargs: Dict[str, Any]) -> Hyper:
        """The record of an unchecked or prepared call's keywords (defaults filled in)."""
        values = []
        for name, fast, default in self._fast:
            value = kwargs.pop(name, default)
            if value is _REQUIRED:
                raise TypeError(f"{self.op}: missing the keyword argument {name!r}")
            values.append(value if fast is None or value is None else fast(value))
        if kwargs:
            raise TypeError(f"{self.op}: unexpected keyword arguments {sorted(kwargs)}")
        return self.Hyper(*values)

    def unchecked(self, *lists: Any, backend: str = "auto", **kwargs: Any) -> None:
        """The op's body without its metadata checks and torch.library's dispatch, for a
        caller that checked the same call once (a mismatched call here is undefined);
        bit-identical to the registered op, whose version-counter bumps it repeats."""
        kwargs.pop("check_indices", None)  # the data checks are the caller's
        settings = {a.name: a.fast(kwargs.pop(a.name)) for a in self.args
                    if a.role != "hyper" and a.keyword}
        t = self.Tensors(*(self.by_name[n].fast(v) for n, v in zip(self._positional, lists)),
                         **settings)
        self.apply(t, self.hyper_from(kwargs), backend)
        torch._C._increment_version([x for n in self.written for x in getattr(t, n)])

    def prepare(self, *lists: Any, backend: str = "auto", **settings: Any) -> "Prepared":
        """The op over these tensors (every list but the gradients, in schema order),
        to be called with each step's gradients and scalars
        (:mod:`frugal_kernels.ops.prepared`)."""
        names = [n for n in self._lists if n != "grads"]
        given = dict(zip(names, lists), grads=[])
        return Prepared(self, self.Tensors(**given, **settings), backend)


class Prepared(PreparedCall):
    """An op over fixed tensors: each call gives the gradients and the hyper-parameters
    (as keywords of the op's public function)."""

    def __init__(self, spec: OpSpec, t: NamedTuple, backend: str):
        self.spec = spec
        self.op, self.impls, self.prepared = spec.op, spec.impls, spec.prepares
        written = [x for n in spec.written for x in getattr(t, n)]
        keep = None
        if spec.skip_empty:
            lead = getattr(t, spec.lead)
            kept = [i for i, x in enumerate(lead) if x.numel() > 0]
            if len(kept) < len(lead):
                keep = kept
                t = spec.Tensors(*([v[i] for i in kept] if n in spec._lists and n != "grads"
                                   else v for n, v in zip(t._fields, t)))
        t = t._replace(**{n: [x.contiguous() for x in getattr(t, n)]
                          for n in spec._contiguous if n != "grads"})
        super().__init__(t, written, backend, keep)

    def __call__(self, grads: List[Tensor], **kwargs: Any) -> None:
        self._run(grads, self.spec.hyper_from(kwargs))
