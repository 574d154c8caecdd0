"""HumanEval inside a training run (``--eval-humaneval-interval``), handed to the loop as a callback by
pretrain.py: the loop calls it and logs what it returns, and imports neither evaluation nor generation."""

from __future__ import annotations

from typing import Callable

from codegeex_train.distributed.topology import Topology
from codegeex_train.evaluation.humaneval import evaluate_humaneval
from codegeex_train.generation import HUMANEVAL_STOP, Generator, SamplingParams


def humaneval_callback(engine, tokenizer, device, topology: Topology, *, tasks: int, max_new_tokens: int,
                       execute: bool) -> Callable[[int], dict | None]:
    """iteration -> greedy pass@1 on the first ``tasks`` HumanEval problems, or None.

    Generation is collective over TP only, so DP rank 0's TP group generates (the others go on and wait for it
    in the next step's collectives); only the rank with ``execute`` (the logging rank) runs the completions in
    the sandbox and returns the metrics. Prompts the model cannot take (e.g. longer than its positions) skip the
    evaluation with a warning, the same on every rank."""
    params = SamplingParams(max_new_tokens=max_new_tokens, stop=HUMANEVAL_STOP)

    def evaluate(iteration: int) -> dict | None:
        if topology.dp_rank != 0:
            return None
        generator = Generator(engine.module, tokenizer, device)  # puts the module in eval mode
        try:
            return evaluate_humaneval(generator, tasks=tasks, num_samples=1, ks=(1,), params=params,
                                      execute=execute)
        except ValueError as e:
            if topology.rank == 0:
                print(f"warning: --eval-humaneval-interval skipped at iteration {iteration}: {e}", flush=True)
            return None
        finally:
            engine.train()

    return evaluate
