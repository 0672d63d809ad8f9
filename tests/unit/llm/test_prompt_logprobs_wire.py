"""Prompt logprobs in Dynamo 1.x's shape (what a 1.x frontend reads from a worker's ``engine_data``)."""

from dynamo.llm.protocols.wire import MIN_PROMPT_LOGPROB, prompt_logprobs_on_wire


def test_each_prompt_token_is_a_map_of_string_ids_ranked_among_the_alternatives():
    ours = [None,
            {"logprob": -0.5, "top_logprobs": [{"token_id": 9, "logprob": -2.0}, {"token_id": 7, "logprob": -0.5}]},
            {"logprob": float("-inf"), "top_logprobs": [{"token_id": 3, "logprob": -0.1}]}]
    assert prompt_logprobs_on_wire([5, 7, 8], ours) == [
        None,
        {"7": {"logprob": -0.5, "rank": 1}, "9": {"logprob": -2.0, "rank": 2}},  # the token among them: its rank
        {"3": {"logprob": -0.1, "rank": 1}, "8": {"logprob": MIN_PROMPT_LOGPROB}},  # not among them: no rank; -inf floored
    ]


def test_a_short_answer_leaves_the_rest_of_the_prompt_null():
    assert prompt_logprobs_on_wire([1, 2, 3], [None, {"logprob": -1.0, "top_logprobs": []}]) == [
        None, {"2": {"logprob": -1.0}}, None]
