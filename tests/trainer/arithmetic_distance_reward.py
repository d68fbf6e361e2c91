"""A dense reward for the synthetic arithmetic task (``custom_reward_function`` of test_rl_vllm.py).

The built-in ``verl/arithmetic`` scorer gives 1 for the exact answer and 0 otherwise, a signal too
sparse for a handful of GRPO steps on a tiny model; this one gives partial credit for near
misses: ``max(0, 1 - |answer - truth| / 5)``, and 0 when no number can be read.
"""

from verl.rewards.arithmetic import extract_answer


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = extract_answer(solution_str)
    try:
        distance = abs(int(answer) - int(ground_truth))
    except (TypeError, ValueError):
        return 0.0
    return max(0.0, 1.0 - distance / 5.0)
