"""Held-out evaluation: response-token loss and perplexity, multiple-choice accuracy, pass@1, per domain.

* Loss: the token-weighted mean negative log-likelihood of the response tokens (labels != -100), so a
  domain's figure does not depend on how its examples are batched.
* Multiple-choice accuracy by answer likelihood: each option's continuation (its letter, the first token of
  the demo's ``"C. <option text>"`` responses) is scored by its log-likelihood after the prompt; the item is
  right when the gold option scores highest (Hendrycks et al. 2021, "Measuring Massive Multitask Language
  Understanding", section 3: the answer is the option letter with the highest probability).
* pass@1: one greedy completion per held-out code problem, run with the problem's tests in a separate,
  resource-limited process (:mod:`.codeexec`); pass@1 is the share of problems whose program exits 0
  (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", section 2.1: with one sample per
  problem the unbiased pass@k estimator reduces to this share).

Which held-out rows are multiple-choice items or code problems is found by :func:`eval_tasks` from the rows'
source fields (the tokenized examples keep only ids, tokens and labels):

* a row with ``choices`` (list of 2-26 option strings) and ``gold`` (the option's letter, or its 0-based
  index) is a multiple-choice item scored on the letters ``A, B, ...`` (so its responses must start with the
  letter); the demo's MMLU rows count as such;
* a row with ``tests`` (list of assert strings, MBPP) and optional ``test_setup_code``, or with ``test`` and
  ``entry_point`` (HumanEval's ``check(candidate)``) and optional ``code_prefix`` (code the completion
  continues), is a code problem; the demo's HumanEval rows count as such.
"""

from .epochs import best_epoch, held_out_losses
from .metrics import heldout_loss, mc_accuracy, pass_at_1
from .stage import EvaluateOutput, Evaluator, evaluate_model_path, ray_evaluator, run
from .tasks import eval_tasks

__all__ = [
    "EvaluateOutput",
    "Evaluator",
    "best_epoch",
    "eval_tasks",
    "evaluate_model_path",
    "held_out_losses",
    "heldout_loss",
    "mc_accuracy",
    "pass_at_1",
    "ray_evaluator",
    "run",
]
