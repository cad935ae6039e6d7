"""Replica groups (parallel.replicas): several launches of one run, each a group of its own
(one process, or DDP or FSDP over its ranks), whose gradients are averaged through torchft's
Manager.
A group that is lost leaves the others stepping at the smaller size; one that (re)joins heals
from a live peer before its first step.

What keeps every sample trained exactly once is not torchft but the run's own data order: each
step begins with a quorum (`regroup`) that says which groups take part and this group's place
among them, and the training sampler is then split over the groups present from the epoch's
position, as a resume onto another world size splits it. A step whose exchange failed is not
committed (`commit`): nothing moves, and the same samples are trained again by the groups
present at the next quorum.

`OneGroup` is the same interface for a run without replica groups: the loop calls both alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TextIO

import torch
from torch import nn
from torch.distributed import ReduceOp

from dtrain.config import ReplicasConfig
from dtrain.core.errors import PeerFailure, UserError, first_line
from dtrain.data.sampler import ResumableSampler
from dtrain.observe import log
from dtrain.parallel.replica_links import (
    advertised_host,
    group_store,
    quiet_torchft,
    recording_members,
    weights_only_transport,
)
from dtrain.process import compat

GROUP_ENV = "DTRAIN_REPLICA_GROUP"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# How long a quorum may take, in parallel.replicas.timeout_s: a joining group waits there for
# the others, and a lighthouse that stopped answering ends the groups after it.
QUORUM_TIMEOUTS = 2
# How often a group with fewer than parallel.replicas.min_groups present asks again.
WAIT_FOR_GROUPS_S = 0.5

HealState = tuple[Callable[[], dict[str, Any]], Callable[[dict[str, Any]], None]]


def group_of(section: ReplicasConfig, environ: dict[str, str]) -> int:
    """This launch's group: parallel.replicas.group, else $DTRAIN_REPLICA_GROUP."""
    group: Any = section.group
    if group is None:
        text = environ.get(GROUP_ENV, "")
        if not text.strip().isdigit():
            raise UserError(
                f"config error: parallel.replicas.groups={section.groups} but this launch's "
                f"group is not known; set parallel.replicas.group or {GROUP_ENV} (0 to "
                f"{section.groups - 1})"
            )
        group = int(text)
    if not 0 <= group < section.groups:
        raise UserError(
            f"config error: replica group {group} is not one of the "
            f"{section.groups} of parallel.replicas.groups (0 to {section.groups - 1})"
        )
    return int(group)


def lighthouse_of(section: ReplicasConfig, environ: dict[str, str]) -> str:
    address = section.lighthouse or environ.get(LIGHTHOUSE_ENV, "")
    if not address:
        raise UserError(
            "config error: parallel.replicas needs a lighthouse; start one with `dtrain "
            f"lighthouse` and set parallel.replicas.lighthouse (or {LIGHTHOUSE_ENV}) to the "
            "address it prints"
        )
    return address if "://" in address else f"http://{address}"


def weights_digest(model: nn.Module) -> str:
    """The content digest of the model's state as this rank holds it (names, shapes, dtypes and
    bytes; its shards under FSDP), as a healed group's rank and its donor's compare it."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        data = compat.local_part(tensor).detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(data.shape)}:{data.dtype};".encode())
        digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return digest.hexdigest()


class Groups:
    """What the loop asks of the replica groups, whether there are several or one."""

    group = 0  # this launch's group
    groups_present = 1  # at the step under way
    place = 0  # this group's place among them

    def regroup(self, step: int) -> bool:
        return False

    def split(self, sampler: ResumableSampler, ranks: int, rank: int) -> int:
        """The training sampler split over the ranks of every group present, numbered as one
        run over all of them would number them (this group's `ranks`, this process its
        `rank`); returns the groups present, by which a step's samples are multiplied."""
        sampler.rank = self.place * ranks + rank
        sampler.world_size = self.groups_present * ranks
        sampler.served = self.served()
        return self.groups_present

    def average(self, model: nn.Module) -> None:
        pass

    def commit(self) -> bool:
        return True

    def trained(self, step: int, sampler: ResumableSampler, last_in_epoch: bool) -> None:
        """A step's sample keys on this rank, where they are logged: once its exchange has
        finished, before the commit (a group killed between the two, whose gradients the
        others took, keeps its line; a step that its group then does not commit gets a line
        that retracts it). The loader batches the sampler's keys in order, so a step's are
        the next ones (the epoch's last step takes what is left)."""
        if sampler.served is None:
            return
        served = sampler.served
        count = len(served) if last_in_epoch else self._keys_per_step
        self._log([served.popleft() for _ in range(min(count, len(served)))], step)

    _keys_per_step = 0  # a rank's samples in a step (batch x accumulation)
    _sample_log: TextIO | None = None
    _logged: int | None = None  # the step of the sample log's last line

    def log_samples(self, path: str | None, keys_per_step: int) -> None:
        """With `path`, the sample log: each step's sample keys on this rank written there
        (parallel.replicas.sample_log, with replica groups or without)."""
        self._keys_per_step = keys_per_step
        # Line-buffered: a process killed mid-run leaves whole lines of the steps it took.
        self._sample_log = open(path, "a", encoding="utf-8", buffering=1) if path else None

    def served(self) -> deque[tuple[int, int]] | None:
        """Where the training sampler puts the keys it serves, for the sample log (None:
        nothing logs them)."""
        return deque() if self._sample_log is not None else None

    def _log(self, keys: list[tuple[int, int]], step: int) -> None:
        assert self._sample_log is not None
        line = {"step": step, "groups": self.groups_present, "place": self.place}
        self._sample_log.write(json.dumps({**line, "samples": keys}) + "\n")
        self._logged = step

    def close(self) -> None:
        if self._sample_log is not None:
            self._sample_log.close()


class OneGroup(Groups):
    """A run without replica groups: one group, always complete, every step committed."""


class Replicas(Groups):
    """This group among the job's replica groups, through a torchft Manager.

    `heal_state`: what a healing peer receives (the run's state as a dict of tensors and plain
    values, read with torch's weights-only loader) and how this group takes it. The model's
    digest travels with it and is checked after it is applied: a heal that does not reproduce
    the donor's weights ends this group (its launcher restarts it) rather than train on them.
    """

    def __init__(
        self,
        section: ReplicasConfig,
        group: int,
        group_rank: int,
        group_size: int,
        model: nn.Module,
        heal_state: HealState,
        step: int,
        keys_per_step: int,
        sample_log: str | None = None,
    ) -> None:
        quiet_torchft()
        self.section, self.group, self.model = section, group, model
        self.groups_present, self.place = 0, 0
        self._heal_state = heal_state
        self._quorum_for: int | None = None
        self._healed_from: int | None = None
        self._waiting = False  # for parallel.replicas.min_groups (said once)
        self._failed_quorum = False  # this step's quorum failed here (said once)
        # The groups in the exchange, as each quorum that changed set it up (None: not yet).
        self.members: set[int] | None = None
        self.log_samples(sample_log, keys_per_step)
        self.lighthouse = lighthouse_of(section, dict(os.environ))
        try:
            self.manager = self._manager(group_rank, group_size)
        except RuntimeError as e:  # the lighthouse gone since the check at the start
            raise PeerFailure(
                f"replica group {group}: cannot join the lighthouse at {self.lighthouse} "
                f"({_shown(e)}); nothing was trained"
            ) from None
        # The Manager counts committed steps from 0; the run may start from a checkpoint.
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def _manager(self, group_rank: int, group_size: int) -> Any:
        """torchft's Manager of this group's rank: a quorum each step, the exchange with the
        same rank of the other groups, heals sent and received (weights-only)."""
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        timeout = timedelta(seconds=self.section.timeout_s)
        host = advertised_host(self.lighthouse)
        port = group_store(group_rank, host)
        return Manager(
            pg=recording_members(ProcessGroupGloo, self, group_size)(timeout=timeout),
            load_state_dict=self._load,
            state_dict=self._state,
            min_replica_size=self.section.min_groups,
            use_async_quorum=False,  # heal before the step's forward, never during it
            timeout=timeout,
            quorum_timeout=timeout * QUORUM_TIMEOUTS,
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=self.lighthouse,
            replica_id=f"group_{self.group}",
            hostname=host,
            checkpoint_transport=weights_only_transport(timeout, host),
        )

    def regroup(self, step: int) -> bool:
        """The quorum of `step` (once a step): which groups take part and this group's place
        among them; a group behind the others is healed here. True when the data must be split
        again: the groups present changed, or this group was healed (its position moved)."""
        if self._quorum_for == step:
            return False
        before, members = (self.groups_present, self.place), self.members
        self._healed_from = None
        try:
            self.manager.start_quorum()
        except PeerFailure:  # a heal received that this group cannot take (`_load`)
            raise
        except Exception as e:  # noqa: BLE001 - no quorum: the lighthouse is gone or silent
            raise PeerFailure(
                f"replica group {self.group}: no quorum from the lighthouse at "
                f"{self.lighthouse} for step {step + 1} ({_shown(e)}); restart it (`dtrain "
                f"lighthouse`) and the groups: they resume from the last checkpoint"
            ) from None
        place, present = self.manager.participating_rank(), self.manager.num_participants()
        if place is None:  # (only with an asynchronous quorum, which this never asks for)
            raise RuntimeError("replica group not taking part after a synchronous quorum")
        self.place, self.groups_present = place, present
        self._quorum_for = self.manager.current_step()
        healed = self._healed_from is not None
        error = self.manager.errored()
        self._failed_quorum = error is not None and not healed
        if self._failed_quorum:  # a heal (or setting up the exchange) that failed: said here
            log.warning(
                f"replica group {self.group}: cannot take part in the step under way "
                f"({_shown(error.original_exception)}): it is not committed, and the next "
                f"quorum tries again (a heal from another live peer)"
            )
        if healed:
            log.info(
                f"replica group {self.group}: healed from a live peer at step "
                f"{self._healed_from} (weights digest checked); {present} group(s) present"
            )
        elif before[0] and present != before[0]:
            log.warning(
                f"replica groups: {before[0]} -> {present} present at step {step + 1}"
                f"{_changed(members, self.members)}; group {self.group} goes on as {place + 1} of "
                f"{present}"
            )
        return healed or (present, place) != before

    def average(self, model: nn.Module) -> None:
        """The gradients averaged over the groups present, each scaled by 1/groups and then
        summed, as DDP averages over ranks (one flat exchange of this rank's part: under FSDP
        its shards, which rank r of every group holds alike)."""
        grads = [compat.local_part(p.grad) for p in model.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads]).mul_(1.0 / self.groups_present)
        self.manager.allreduce(flat, reduce_op=ReduceOp.SUM).wait()
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def commit(self) -> bool:
        """Whether every group present finished the step's exchange: only then is it taken."""
        error = self.manager.errored()
        try:
            committed = bool(self.manager.should_commit())
        except Exception as e:  # noqa: BLE001 - e.g. a heal it serves that never finished
            raise PeerFailure(
                f"replica group {self.group}: step {self.manager.current_step() + 1} cannot be "
                f"committed ({_shown(e)}); this group stops, and heals from a live peer when "
                f"its launcher starts it again"
            ) from None
        if committed:
            self._waiting = False
            return True
        step = self.manager.current_step() + 1
        self._quorum_for = None  # the step is tried again, after a quorum of its own
        self._retract(step)
        if error is None and self.groups_present < self.section.min_groups:
            # Waiting for groups, not failing: said once, and the quorum asked again shortly.
            if not self._waiting:
                log.info(
                    f"replica group {self.group}: waiting for parallel.replicas.min_groups="
                    f"{self.section.min_groups} groups ({self.groups_present} present) before "
                    f"step {step}"
                )
            self._waiting = True
            time.sleep(WAIT_FOR_GROUPS_S)
            return False
        if self._failed_quorum:  # (said by `regroup`)
            return False
        cause = _shown(error.original_exception) if error else "a group did not finish it"
        log.warning(
            f"replica group {self.group}: step {step} not committed ({cause}); it is trained "
            f"again by the groups present"
        )
        return False

    def _log(self, keys: list[tuple[int, int]], step: int) -> None:
        if not self.manager.errored():  # (an exchange that failed: the step is not committed)
            super()._log(keys, step)

    def _retract(self, step: int) -> None:
        if self._sample_log is not None and self._logged == step:
            line = {"step": step, "groups": self.groups_present, "place": self.place}
            self._sample_log.write(json.dumps({**line, "retracted": True}) + "\n")

    def close(self) -> None:
        """Leave the replica groups, saying where this group left them and with what weights
        (the digest every group that reached the same step shares)."""
        super().close()
        log.info(
            f"replica group {self.group}: left at step {self.manager.current_step()}, "
            f"weights digest {weights_digest(self.model)}"
        )
        self.manager.shutdown(wait=False)

    def _state(self) -> dict[str, Any]:
        """What this group sends a group that heals from it (asked once per heal it serves)."""
        log.info(
            f"replica group {self.group}: sending its state at step "
            f"{self.manager.current_step()} to a group that heals from it"
        )
        return {"run": self._heal_state[0](), "digest": weights_digest(self.model)}

    def _load(self, state: dict[str, Any]) -> None:
        """Take a heal received from a live peer. A state that does not fit, or whose weights
        do not reproduce the donor's digest, ends this group (part of it may have been applied):
        its launcher starts it again, and it heals then."""
        step = self.manager.current_step()
        try:
            self._heal_state[1](state["run"])
        except Exception as e:  # noqa: BLE001 - said in a line, with what did not fit
            raise PeerFailure(
                f"replica group {self.group}: the state a live peer sent at step {step} does "
                f"not fit this group ({type(e).__name__}: {_shown(e)}); every group needs the "
                f"same model and the same parallel layout; this group stops"
            ) from None
        if weights_digest(self.model) != state["digest"]:
            raise PeerFailure(
                f"replica group {self.group}: the weights a live peer sent at step {step} do "
                f"not match its digest; this group stops and heals again when it restarts"
            )
        self._healed_from = step


def _changed(before: set[int] | None, now: set[int] | None) -> str:
    """Which groups left and joined between two quorums, for the log: ' (lost: group 1)',
    ' (joined: group 1)', or '' where it is not known."""
    if before is None or now is None:
        return ""
    lost = ", ".join(f"group {g}" for g in sorted(before - now))
    joined = ", ".join(f"group {g}" for g in sorted(now - before))
    shown = "; ".join(
        p for p in (f"lost: {lost}" if lost else "", f"joined: {joined}" if joined else "") if p
    )
    return f" ({shown})" if shown else ""


def _shown(error: BaseException) -> str:
    """A failed exchange's cause in a line: gloo's message without the source location it
    begins with ("[.../pair.cc:561] Connection closed by peer ...") and the advice after it."""
    line = first_line(error)
    line = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
    return line.split(". This is typically caused", 1)[0]  # (gloo's advice to read the logs)
