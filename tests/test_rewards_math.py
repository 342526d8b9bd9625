"""The math and QA graders (slimish/rollout/graders.py) on a table of known cases, as reward
functions (`--reward-fn slimish.rollout.graders:NAME`), and slime's rm types on them
(`slime.rollout.rm_hub.async_rm` of slimish's stand-in)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from slimish.compat.slime.namespace import SlimeArgs, use_slime_namespace
from slimish.plugins import load_function
from slimish.rollout import graders
from slimish.types import Sample

# (model's answer, label, equivalent?): what math-verify must decide.
MATH_CASES = [
    ("1/2", "0.5", True),
    ("\\frac{1}{2}", "1/2", True),
    ("\\dfrac12", "0.5", True),
    ("\\tfrac{3}{4}", "0.75", True),
    ("3", "3.0", True),
    ("3.00", "3", True),
    ("-3", "-3", True),
    ("x+1", "1+x", True),
    ("2x+1", "1+2x", True),
    ("\\sqrt{2}", "2^{1/2}", True),
    ("5\\sqrt{2}", "\\sqrt{50}", True),
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}", True),
    ("\\frac{\\pi}{2}", "\\pi/2", True),
    ("2\\pi", "\\pi \\cdot 2", True),
    ("1,000", "1000", True),
    ("10^3", "1000", True),
    ("x=5", "5", True),
    ("y=2x+1", "y=1+2x", True),
    ("\\{1,2\\}", "\\{2,1\\}", True),
    ("2, 1", "1,2", True),
    ("[1,2)", "[1,2)", True),
    ("(0, \\infty)", "(0,\\infty)", True),
    ("\\infty", "\\infty", True),
    ("\\text{(B)}", "B", True),
    ("12\\%", "12", True),
    ("3^\\circ", "3", True),
    ("\\frac{1}{3}", "0.333333", True),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("(1, 2)", "(1,2)", True),
    ("\\frac{2}{4}", "\\frac{1}{2}", True),
    ("0.5", "\\boxed{\\frac{1}{2}}", True),  # a boxed label is reduced to its box
    ("\\frac{6}{3}", "2", True),
    ("\\log_2 8", "3", True),
    ("6", "3!", True),
    ("a^2-b^2", "(a-b)(a+b)", True),
    ("42", "42", True),
    ("2", "3", False),
    ("-3", "3", False),
    ("1/3", "0.333", False),
    ("x+1", "x-1", False),
    ("\\sqrt{3}", "\\sqrt{2}", False),
    ("(1,2)", "(2,1)", False),
    ("\\{1,2\\}", "\\{1,3\\}", False),
    ("[1,2]", "(1,2)", False),
    ("\\pi", "3.14", False),
    ("10", "100", False),
    ("\\frac{1}{2}", "\\frac{1}{3}", False),
    ("x=5", "6", False),
    ("2x", "x^2", False),
    ("\\infty", "-\\infty", False),
    ("0", "", False),  # no label: nothing is right
    (None, "3", False),  # no answer: wrong
    ("1000", "1001", False),
    ("e", "2.71", False),
]

# (response, what `extract_final_answer` takes from it)
EXTRACTION_CASES = [
    ("so the answer is \\boxed{42}.", "42"),
    ("first \\boxed{1}, finally \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("Some work.\nAnswer: 17", "17"),
    ("answer: 3.\nAnswer: 5.", "5"),
    ("Natalia sold 48 clips.\n#### 72", "72"),
    ("\\boxed{unclosed and Answer: 9", "9"),
    ("no answer here", None),
]


def test_at_least_fifty_math_cases_are_decided_as_known() -> None:
    assert len(MATH_CASES) >= 50
    wrong = [(given, label) for given, label, same in MATH_CASES if graders.math_equal(given, label) != same]
    assert wrong == []


def test_final_answers_are_extracted_from_boxes_answer_lines_and_gsm8k_marks() -> None:
    assert [graders.extract_final_answer(text) for text, _ in EXTRACTION_CASES] == [a for _, a in EXTRACTION_CASES]


def test_dapo_scores_the_last_answer_line_of_the_tail() -> None:
    assert graders.dapo_score("work\nAnswer: 1/2", "0.5") == {"score": 1.0, "acc": True, "pred": "1/2"}
    assert graders.dapo_score("Answer: 3\nAnswer: 4", "3") == {"score": -1.0, "acc": False, "pred": "4"}
    assert graders.dapo_score("\\boxed{3}", "3") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    # Only the last 300 characters count: an answer line before them is not seen.
    assert graders.dapo_score("Answer: 3\n" + "x" * 300, "3")["pred"] == "[INVALID]"


@pytest.mark.parametrize(
    ("prediction", "truth", "f1", "em"),
    [
        ("The Eiffel Tower", "eiffel tower", 1.0, True),
        ("Paris, France", "Paris", 2 / 3, False),
        ("in Paris", "Paris France", 0.5, False),
        ("yes", "no", 0.0, False),
        ("yes.", "Yes", 1.0, True),
        ("London", "Paris", 0.0, False),
        (None, "Paris", 0.0, False),
        ("Paris", ["Lyon", "the Paris"], 0.0, True),  # exact match takes any of several truths
    ],
)
def test_f1_and_exact_match_normalise_as_squad(prediction: Any, truth: Any, f1: float, em: bool) -> None:
    if not isinstance(truth, list):
        assert graders.f1_score(prediction, truth)[0] == pytest.approx(f1)
    assert graders.exact_match(prediction, truth) is em


class CharTokenizer:
    """Ids are characters: what `final_turn_text` decodes, without a vocabulary."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(chr, ids))


def answered(text: str, label: str, observation: str = " [tool output] ") -> Sample:
    """A sample whose last model turn is `text`, after a model turn and an observation (mask 0)."""
    first, obs = [ord(c) for c in "let me check "], [ord(c) for c in observation]
    ids = first + obs + [ord(c) for c in text]
    return Sample(
        prompt="q",
        label=label,
        tokens=[1, 2] + ids,
        response_length=len(ids),
        loss_mask=[1] * len(first) + [0] * len(obs) + [1] * len(text),
        rollout_logprobs=[0.0] * len(ids),
    )


def test_the_graders_are_reward_functions() -> None:
    """Loaded as `--reward-fn` loads them, scoring the model's last turn only (an observation's
    `\\boxed{7}` is not the model's answer)."""
    ctx = type("Ctx", (), {"tokenizer": CharTokenizer()})()

    def score(name: str, sample: Sample) -> Any:
        return asyncio.run(load_function(f"slimish.rollout.graders:{name}", "reward")(ctx, sample))

    assert score("math_verify_reward", answered("so \\boxed{\\frac{1}{2}}", "0.5")) == 1.0
    assert score("math_verify_reward", answered("no box", "7", observation="\\boxed{7}")) == 0.0
    assert score("dapo_reward", answered("Answer: 12", "12"))["score"] == 1.0
    assert score("f1_reward", answered("Answer: the Eiffel Tower", "Eiffel Tower")) == 1.0
    assert score("exact_match_reward", answered("Paris", "paris")) == 1.0


def slime_rm(response: str, label: Any, rm_type: str, metadata: dict | None = None) -> Any:
    use_slime_namespace()
    from slime.rollout.rm_hub import async_rm
    from slime.utils.types import Sample as SlimeSample

    sample = SlimeSample(prompt="q", response=response, label=label, metadata=metadata or {})
    return asyncio.run(async_rm(SlimeArgs(custom_rm_path=None, rm_type=rm_type), sample))


def test_slimes_rm_types_score_on_slimishs_graders() -> None:
    assert slime_rm("thus \\boxed{0.5}", "\\frac{1}{2}", "math") == 1
    assert slime_rm("thus \\boxed{0.6}", "\\frac{1}{2}", "math") == 0
    assert slime_rm("<think>hmm</think> \\boxed{2\\pi}", "2\\pi", "deepscaler") == 1
    assert slime_rm("\\boxed{2\\pi}", "2\\pi", "deepscaler") == 0  # no reasoning marker: not graded
    assert slime_rm("Answer: 34", "34", "dapo") == {"score": 1.0, "acc": True, "pred": "34"}
    assert slime_rm("the Eiffel Tower", "Eiffel Tower", "f1") == 1.0
    assert slime_rm("reasoning... \\boxed{Eiffel Tower}", "Eiffel Tower", "boxed_f1") == 1.0
    assert slime_rm("The answer is (C).", "C", "gpqa") == 1.0
    assert slime_rm("The answer is (C).", 1, "gpqa") == 0.0  # label index 1 is B
    assert slime_rm("I pick Paris", "Paris", "gpqa", {"choices": ["Lyon", "Paris"]}) == 0.0  # it named no letter
    assert slime_rm("Answer: B", "Paris", "gpqa", {"choices": ["Lyon", "Paris"]}) == 1.0
    assert slime_rm("x", "y", "random") in (0, 1)
    assert slime_rm("x", "y", "", {"rm_type": "f1"}) == 0.0  # the sample's own rm_type
    with pytest.raises(NotImplementedError, match="rm_type 'ifbench' is not provided"):
        slime_rm("x", "y", "ifbench")
    with pytest.raises(NotImplementedError, match="set rollout.args.rm_type"):
        slime_rm("x", "y", "")
