"""The quickstart (configs/quickstart.yaml) shortened: after the SFT warm start the held-out
accuracy is near chance; thirty GRPO steps later it has clearly risen, and the policy still
ends its turns at the demonstrations' length. Without the overlong penalty every response ran to
`max_new_tokens` from step ~25 on (a right answer followed by junk scored 1 all the same), so
thirty steps is where that shows. The full run is `make demo`."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.learning, pytest.mark.timeout(1500)]  # minutes on a loaded machine


def test_short_quickstart_raises_accuracy_and_keeps_ending_turns(quickstart_grpo: tuple[list[dict], Path]) -> None:
    rows = [r for r in quickstart_grpo[0] if r["step"] <= 30]  # the session's run, as a 30-step run
    assert [r["step"] for r in rows] == list(range(31))
    before, after = rows[0]["eval/accuracy"], rows[-1]["eval/accuracy"]
    assert before < 0.3, f"SFT alone should leave accuracy near chance, got {before}"
    assert after >= before + 0.2, f"held-out accuracy {before} -> {after} after 30 RL steps"
    assert all(r["train/mismatch"] < 1e-4 for r in rows[1:])  # fp32 engine and trainer agree
    demonstrated = rows[0]["eval/response_length"]  # greedy, right after SFT: the demonstrations' length
    last = rows[-10:]
    truncated = sum(r["rollout/truncated_fraction"] for r in last) / len(last)
    length = sum(r["response/length"] for r in last) / len(last)
    assert truncated <= 0.05 and abs(length - demonstrated) <= 1, (
        f"truncated {truncated:.3f}, length {length:.2f} vs {demonstrated}"
    )
