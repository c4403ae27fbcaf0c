"""The tags of a pipeline's point-to-point transfers (artifacts/FORMAT.md, "Pipeline").

Both sides of a transfer issue it with the same tag, unique per microbatch, stage pair, value and
direction, so transfers match whatever order they are issued in. The build writes the tags
(aot/capture/pipeline.py); the runner reads them back to say which transfer a stuck or failed
wait was for (runner/execution/p2p.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from runner.errors import AotError

_FIELD = 64  # stages, and outputs of a stage, per tag field: the build refuses more


def transfer_tag(microbatch: int, producer: int, consumer: int, output: int, backward: bool) -> int:
    """(((m x 64 + p) x 64 + c) x 64 + j) x 2 + b: microbatch m, producing stage p, consuming
    stage c, output j of p; b = 1 for its gradient (sent by c back to p). Refuses (AotError) a
    stage or output number the tag has no room for: two transfers would share a tag."""
    if not (0 <= producer < _FIELD and 0 <= consumer < _FIELD and 0 <= output < _FIELD and microbatch >= 0):
        raise AotError(
            f"a pipeline transfer between stages {producer} and {consumer} (output {output}): the format's transfer tags hold "
            f"at most {_FIELD} stages and {_FIELD} outputs per stage; use fewer pipeline stages"
        )
    return (((microbatch * _FIELD + producer) * _FIELD + consumer) * _FIELD + output) * 2 + int(backward)


@dataclass(frozen=True)
class Transfer:
    """What one tag moves: output `output` of stage `producer` to stage `consumer` for one
    microbatch, or (`backward`) its gradient from the consumer back to the producer."""

    microbatch: int
    producer: int
    consumer: int
    output: int
    backward: bool

    @classmethod
    def of_tag(cls, tag: int) -> "Transfer":
        backward, rest = tag % 2, tag // 2
        output, rest = rest % _FIELD, rest // _FIELD
        consumer, rest = rest % _FIELD, rest // _FIELD
        producer, microbatch = rest % _FIELD, rest // _FIELD
        return cls(microbatch, producer, consumer, output, bool(backward))

    @property
    def source(self) -> int:
        """The stage that sends it."""
        return self.consumer if self.backward else self.producer

    @property
    def destination(self) -> int:
        """The stage that receives it."""
        return self.producer if self.backward else self.consumer

    @property
    def direction(self) -> str:
        return "backward" if self.backward else "forward"

    def describe(self) -> str:
        """'microbatch 2's gradient from stage 1 to stage 0'."""
        what = "gradient" if self.backward else "activation"
        value = f" (output {self.output})" if self.output else ""
        return f"microbatch {self.microbatch}'s {what}{value} from stage {self.source} to stage {self.destination}"
