"""A reward the raw tiny model can learn in a few GRPO steps (``custom_reward_function`` of
test_python_api_resume.py, and the scorer of test_python_api_learning.py): the number of words
in an 8-token response, i.e. its spaces over 8, at most 1. Every response gets a spread of
scores, unlike the arithmetic scorers, which the untrained model almost never satisfies."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return min(solution_str.count(" "), 8) / 8.0
