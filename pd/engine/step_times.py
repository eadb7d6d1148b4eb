"""How long the engine's steps take, summed so a reader can fit a replica's capacity from them.

A step that computed prompt tokens counts as prefill time; a step that
computed none counts as a decode step of its batch size ``b``. The decode
sums are those of a least-squares fit of step time ``t = a + c * b``
(``autoscale.capacity`` does the fit). All are cumulative and never reset, so
a reader differences two reads for a period's figures.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepTimes:
    prefill_seconds: float = 0.0  # steps that computed prompt tokens
    decode_steps: int = 0  # steps that computed none: n
    decode_seconds: float = 0.0  # sum of t
    decode_seqs: int = 0  # sum of b
    decode_seqs_sq: int = 0  # sum of b * b
    decode_seq_seconds: float = 0.0  # sum of t * b

    def record(self, seconds: float, num_prompt_tokens: int, num_seqs: int) -> None:
        if num_prompt_tokens:
            self.prefill_seconds += seconds
            return
        self.decode_steps += 1
        self.decode_seconds += seconds
        self.decode_seqs += num_seqs
        self.decode_seqs_sq += num_seqs * num_seqs
        self.decode_seq_seconds += seconds * num_seqs
