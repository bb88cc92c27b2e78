"""The capture audit: every tensor captured work touches must be stable across replays.

A graph replays against the addresses it captured. A tensor a captured segment reads (or
writes) is stable only if it was allocated by captured work itself (the graph owns it), is a
module parameter, or belongs to memory the runner registered as static (``StaticMemory``:
input buffers, persistent metadata, KV caches, registered modules' parameters and buffers).
Anything else — a metadata tensor the runner builds anew every step, a tensor an eager segment
allocates (replay re-runs the eager segment, which allocates a *new* tensor the graph never
sees) — is read stale on replay: the seed's bug. The audit names the op, the tensor's shape and
where it was allocated, at capture time.

``CaptureAudit`` is a dispatch mode active for the whole capture, eager segments included, so
it is independent of the graph backend (it works under a CUDA graph capture too). It checks
only while the capture is capturing; it tracks allocations always.

Modes: ``"raise"`` (``CaptureAuditError`` at the first finding), ``"report"`` (collect findings
into an ``AuditReport``), ``"off"`` (no audit mode at all).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, Literal

import attrs
import torch

from graphs._ops import LITERALS, QuietDispatchMode, arguments, is_like_factory, op_name
from graphs._source import user_location
from graphs._tensor_refs import WeakStorage, map_tensors, storage_key
from graphs.allocations import AllocationSites, AllocationTracker, new_allocations
from graphs.errors import CaptureAuditError
from graphs.static_memory import StaticMemory

__all__ = ["AUDIT_MODES", "AuditFinding", "AuditMode", "AuditReport", "CaptureAudit"]

AuditMode = Literal["raise", "report", "off"]
AUDIT_MODES: tuple[AuditMode, ...] = ("raise", "report", "off")


@attrs.frozen(kw_only=True)
class AuditFinding:
    """One unstable access: ``op`` ``access`` (reads/writes) a tensor of ``shape``/``dtype``."""

    op: str
    access: str
    shape: tuple[int, ...]
    dtype: str
    allocated_at: str
    location: str
    consequence: str = "replay would use stale memory"

    @property
    def message(self) -> str:
        return (
            f"captured {self.op} {self.access} a {list(self.shape)} {self.dtype} tensor "
            f"allocated {self.allocated_at}; it is not produced by captured work, not a module "
            f"parameter and not registered static memory, so {self.consequence} "
            f"(at {self.location})"
        )

    def __str__(self) -> str:
        return self.message


@attrs.frozen(kw_only=True)
class AuditReport:
    """The findings of one capture's audit (empty when ``mode`` is ``"off"``)."""

    mode: AuditMode
    findings: tuple[AuditFinding, ...] = ()

    @property
    def ok(self) -> bool:
        return not self.findings

    def __len__(self) -> int:
        return len(self.findings)

    def __iter__(self) -> Iterator[AuditFinding]:
        return iter(self.findings)

    def __str__(self) -> str:
        if self.mode == "off":
            return "capture audit: off"
        if self.ok:
            return "capture audit: no unstable accesses"
        lines = [f"capture audit: {len(self.findings)} unstable access(es)"]
        lines.extend(f"- {f.message}" for f in self.findings)
        return "\n".join(lines)


def _accessed(
    func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Iterator[tuple[torch.Tensor, str]]:
    """Each tensor argument of ``func`` with ``"reads"`` or ``"writes"`` per its schema."""
    for value, written in arguments(func, args, kwargs):
        access = "writes" if written else "reads"
        values = value if isinstance(value, (list, tuple)) else (value,)
        for v in values:
            if isinstance(v, torch.Tensor):
                yield v, access


_EAGER_ARGUMENT_CONSEQUENCE = (
    "every replay would re-run the break on its capture-time value, which a CUDA graph holds "
    "only by address (it may dangle once freed); pass static memory or captured outputs"
)


@functools.cache
def _touches_data(func: torch._ops.OpOverload) -> bool:
    """False for ops that make or reshape metadata only: literals, ``new_*`` and ``*_like``
    factories, in-place views."""
    name = op_name(func)
    return not (name in LITERALS or is_like_factory(name) or torch.Tag.inplace_view in func.tags)


class CaptureAudit(QuietDispatchMode):
    """Dispatch mode auditing one capture; enter it before the capture's first segment."""

    def __init__(
        self,
        *,
        mode: AuditMode,
        static: StaticMemory | None = None,
        allocations: AllocationTracker | None = None,
    ) -> None:
        super().__init__()
        if mode not in AUDIT_MODES:
            raise ValueError(f"unknown audit mode {mode!r}; expected one of {AUDIT_MODES}")
        self.mode: AuditMode = mode
        self.capturing = False
        """Whether a graph segment records now (the capture sets it): only then are accesses
        checked."""
        self._static = static.storages() if static is not None else {}
        self._allocations = allocations
        self._stable: dict[int, WeakStorage | None] = {}
        self._eager = AllocationSites()
        self._findings: list[AuditFinding] = []
        self._seen: set[tuple[int, str, str]] = set()

    def report(self) -> AuditReport:
        return AuditReport(mode=self.mode, findings=tuple(self._findings))

    def dispatch(
        self, func: torch._ops.OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        capturing = self.capturing
        result = func(*args, **kwargs)
        allocated = new_allocations(func, args, kwargs, result)
        if capturing and _touches_data(func):
            # A view touches no data: its uses are checked, by storage, when they happen.
            view = not allocated and not func._schema.is_mutable
            for tensor, access in _accessed(func, args, kwargs):
                if not view:
                    self._check(func, tensor, access)
                elif isinstance(tensor, torch.nn.Parameter):
                    self._stable.setdefault(storage_key(tensor), None)
        if capturing:
            for t in allocated:
                self._stable.setdefault(storage_key(t), WeakStorage(t.untyped_storage()))
        elif allocated:
            site = f"inside an eager segment by {func} at {user_location()}"
            for t in allocated:
                self._eager.add(t, site)
        return result

    def check_eager_arguments(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """Check the tensors an eager break is called with (inside containers and attrs values:
        those ``map_tensors`` reaches, as a backend's ``hold`` does) as captured reads are
        checked: each must be stable across replays."""
        name = f"eager break {getattr(fn, '__qualname__', repr(fn))}"

        def check(tensor: torch.Tensor) -> torch.Tensor:
            self._check(name, tensor, "is called with", _EAGER_ARGUMENT_CONSEQUENCE)
            return tensor

        map_tensors((args, kwargs), check)

    def _check(
        self,
        func: torch._ops.OpOverload | str,
        tensor: torch.Tensor,
        access: str,
        consequence: str | None = None,
    ) -> None:
        key = storage_key(tensor)
        if key in self._stable or key in self._static:
            return
        if isinstance(tensor, torch.nn.Parameter):
            self._stable[key] = None  # parameters are held by their module
            return
        location = user_location()
        if (key, str(func), location) in self._seen:
            return
        self._seen.add((key, str(func), location))
        finding = AuditFinding(
            op=str(func),
            access=access,
            shape=tuple(tensor.shape),
            dtype=str(tensor.dtype).removeprefix("torch."),
            allocated_at=self._allocated_at(tensor),
            location=location,
            **({} if consequence is None else {"consequence": consequence}),
        )
        if self.mode == "raise":
            raise CaptureAuditError(finding.message)
        self._findings.append(finding)

    def _allocated_at(self, tensor: torch.Tensor) -> str:
        eager_site = self._eager.site_of(tensor)
        if eager_site is not None:
            return (
                f"{eager_site} (an eager segment allocates anew on every replay; have it write "
                "into a buffer allocated before the break)"
            )
        site = self._allocations.site_of(tensor) if self._allocations is not None else None
        if site is not None:
            return f"outside the capture by {site}"
        return "outside the capture (site unknown: track it with an AllocationTracker)"
