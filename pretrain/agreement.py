"""What every rank must agree on at a step, in the step's one all-reduce, read by the loop as one
decision: whether a stop signal reached any rank (all save this step and leave), whether any rank's
reads failed (all stop with that rank's line), whether an async save is still being written on any
rank (it is put in place once none writes), and whether the step is skipped (pretrain/spikes.py: a
spike, or a loss or gradient norm that is not finite, on any rank). The all-reduce is the loop's one
host sync, before optimizer.step(), so a skipped step or a bad batch never reaches the weights; at a
different step on different ranks, the saves and the stops would deadlock.

    agreement = StepAgreement(stop, guard, checkpointer.saver, device, dp_group)
    decision = agreement.on_step(loss_shares, grad_norm, data_error)
    if not decision.skip:
        optimizer.step()
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from pretrain.distributed import agree


@dataclass
class Decision:
    stop: bool  # a stop signal reached a rank: every rank saves this step and leaves
    skip: bool  # the step is not applied: a spike, or a loss or gradient norm that is not finite
    not_finite: bool  # the skip is for a value that is not finite
    save_done: bool  # the async save in flight is written on every rank: put it in place


class StepAgreement:
    """stop: the list stop_on_signals() appends to; guard: the run's SpikeGuard; saver: the
    checkpoint folder's Saver; dp_group: the data-parallel ranks, over which the loss is summed."""

    def __init__(self, stop: list, guard, saver, device, dp_group):
        self.stop = stop
        self.guard = guard
        self.saver = saver
        self.device = device
        self.dp_group = dp_group

    # A range of its own in a profile (bench.py profile reports the device's idle time around its end); outside
    # a profiler it costs a few microseconds a step.
    @torch.profiler.record_function("StepAgreement.on_step")
    def on_step(self, loss_shares: list, grad_norm: torch.Tensor, data_error) -> Decision:
        """loss_shares: this rank's (2,) loss shares (cross-entropy, z term) of each micro-batch;
        data_error: this rank's failed read ("" if none), raised on every rank."""
        cross_entropy = [share[0] for share in loss_shares]
        verdict = self.guard.check(cross_entropy, grad_norm, self.dp_group)  # (2,) on the device
        in_flight = self.saver.pending is not None
        flags = torch.tensor([bool(self.stop), bool(data_error), self.saver.writing()],
                             device=self.device)
        flags = torch.cat([flags.int(), verdict])  # (5,)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        stop, data_failed, writing, not_finite, is_spike = flags.tolist()
        if data_failed:
            agree(data_error, self.device)  # every rank raises the failed rank's line
        return Decision(stop=bool(stop), skip=bool(not_finite or is_spike),
                        not_finite=bool(not_finite), save_done=in_flight and not writing)
