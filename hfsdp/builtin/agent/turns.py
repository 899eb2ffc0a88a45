"""Multi-turn rollouts: a completion's tool calls run, their results appended, the model sampled again, until no row
calls or a limit is reached (:func:`act`), as TRL 1.16's ``GRPOTrainer._tool_call_loop`` does it: the results are
``tool`` messages whose tokens come from the chat template's suffix after a tool call (:func:`tool_suffix_ids`) and
are masked out of the loss (``tool_mask`` 0), a result that would carry the completion past ``max_new_tokens`` (or
the model's context) is rolled back and its row stops, a later turn is cut to what is left of the budget, and
``max_tool_calling_iterations`` bounds the rounds of calls. Unlike TRL, the calls run in worker processes
(:class:`hfsdp.builtin.agent.runtime.ToolWorkers`), and every rank takes every turn in lock-step: a turn's padding
width and length are the largest over all ranks, and a rank without rows left samples a padding row with the others,
so that a rollout's tokens depend on its prompt, its seeds (one per turn) and the tools' answers alone, on any
number of ranks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from hfsdp.builtin.chat import parse_completion


@dataclass
class Rollout:
    """One completion of a multi-turn rollout: its prompt's ids, the completion's ids (every turn with the tool
    results between them), which of them the model sampled (``tool_mask``: 1) and the messages they are (the
    assistant turns as the response format parses them, each tool result as TRL's ``tool`` message)."""

    prompt_ids: list[int]
    completion_ids: list[int]
    tool_mask: list[int]
    messages: list[dict[str, Any]]
    calls: int = 0
    failures: int = 0
    turns: int = 1
    rolled_back: int = 0
    failure_kinds: dict[str, int] = field(default_factory=dict)


def tool_suffix_ids(tokenizer, tool_messages: list[dict[str, Any]]) -> list[int]:
    """The tokens the chat template puts after an assistant turn of tool calls: the ``tool_messages`` and the next
    generation prompt (TRL's ``_get_tool_suffix_ids``: a dummy conversation rendered with and without them, its end of
    turn kept at the EOS token); ValueError where the one is not a prefix of the other."""
    calls = [{"type": "function", "function": {"name": tool_messages[0]["name"], "arguments": {}}}]
    dummy = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    prefix = tokenizer.apply_chat_template(dummy, add_generation_prompt=False, tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(dummy + tool_messages, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)
    eos = [i for i, t in enumerate(prefix) if t == tokenizer.eos_token_id]
    if eos:
        prefix = prefix[: eos[-1] + 1]
    if full[: len(prefix)] != prefix:
        raise ValueError("the chat template renders an assistant turn of tool calls differently once tool results "
                         "follow it (the conversation before them is not a prefix of the one with them)")
    return full[len(prefix):]


def ordered_calls(calls: list[dict[str, Any]], asynchronous: frozenset[str]) -> list[tuple[str, Any]]:
    """A turn's tool calls (function calls, as :func:`hfsdp.builtin.chat.parse_completion` gives them) as ``(name,
    arguments)`` in the order TRL appends their results: the synchronous ones (and unknown names) in the turn's
    order, then the coroutine functions' (``asynchronous``) in theirs."""
    calls = [(c["function"]["name"], c["function"].get("arguments", {})) for c in calls]
    return [c for c in calls if c[0] not in asynchronous] + [c for c in calls if c[0] in asynchronous]


def act(sample: Callable[[list[list[int]], list[int], int, int], list[list[int]]],
        gather: Callable[[Any], list[Any]], prompts: list[list[int]], tools: list[list[dict] | None],
        asynchronous: list[frozenset[str]], seed_of: Callable[[int, int], int], workers, tokenizer, budget: int,
        context: int, iterations: int | None) -> list[Rollout]:
    """This rank's rollouts of ``prompts`` (token ids, each rendered with its ``tools``' schemas; ``asynchronous``:
    each one's coroutine tools), turn ``t`` of rollout ``i`` sampled with the generator seeded ``seed_of(i, t)``,
    the calls run by ``workers`` (opened for these rollouts), at most ``budget`` tokens a completion
    (``max_new_tokens``) and ``context`` in all, at most ``iterations`` rounds of calls (None: no limit).
    ``sample(prompts, seeds, width, max_new_tokens)`` samples with every rank (collective), left-padding to
    ``width``; ``gather(value)`` is every rank's value, in rank order (collective). Every rank calls this in
    lock-step."""
    width = max(max(map(len, part), default=0) for part in gather(prompts))
    sampled = sample(prompts, [seed_of(i, 0) for i in range(len(prompts))], width, budget)
    rollouts = [Rollout(list(p), list(c), [1] * len(c), [parse_completion(tokenizer, c, p, tools[i])])
                for i, (p, c) in enumerate(zip(prompts, sampled))]
    active = [i for i, r in enumerate(rollouts) if r.messages[-1].get("tool_calls")]
    iteration = 0
    while iterations is None or iteration < iterations:
        extended = _run_calls(rollouts, active, asynchronous, workers, tokenizer, budget, context)
        active = [i for i in active if i in extended]
        everyone = gather([(len(extended[i]), budget - (len(extended[i]) - len(rollouts[i].prompt_ids)))
                           for i in active])
        if not any(everyone):
            break
        turn = iteration + 1
        widest = max(n for part in everyone for n, _ in part)
        longest = max(left for part in everyone for _, left in part)
        post = sample([extended[i] for i in active], [seed_of(i, turn) for i in active], widest, longest)
        for i, ids in zip(active, post):
            rollout = rollouts[i]
            so_far = extended[i]
            ids = ids[: budget - (len(so_far) - len(rollout.prompt_ids))]
            tool_length = len(so_far) - len(rollout.prompt_ids) - len(rollout.completion_ids)
            rollout.tool_mask += [0] * tool_length + [1] * len(ids)
            rollout.completion_ids = so_far[len(rollout.prompt_ids):] + ids
            rollout.turns += 1
            if ids:
                rollout.messages.append(parse_completion(tokenizer, ids, so_far, tools[i]))
        active = [i for i, ids in zip(active, post) if ids and rollouts[i].messages[-1].get("tool_calls")]
        iteration += 1
    return rollouts


def _run_calls(rollouts: list[Rollout], active: list[int], asynchronous: list[frozenset[str]], workers, tokenizer,
               budget: int, context: int) -> dict[int, list[int]]:
    """Run the tool calls of the ``active`` rollouts' last turns (all at once: each rollout's in its own worker),
    append the assistant turn's results as tool messages, and return each rollout's ids to sample on from (prompt,
    completion, the results' suffix); a rollout whose results would pass ``budget`` or ``context`` has them rolled
    back and is left out (it stops)."""
    plan = [(i, ordered_calls(rollouts[i].messages[-1]["tool_calls"], asynchronous[i])) for i in active]
    requests = [(i, name, arguments) for i, calls in plan for name, arguments in calls]
    answers = iter(workers.call(requests) if requests else ())
    extended = {}
    for i, calls in plan:
        rollout, before = rollouts[i], len(rollouts[i].messages)
        results = []
        for name, _ in calls:
            rollout.calls += 1
            content, failure = next(answers)
            if failure is not None:
                rollout.failures += 1
                rollout.failure_kinds[failure] = rollout.failure_kinds.get(failure, 0) + 1
            results.append({"role": "tool", "name": name, "content": content})
        rollout.messages += results
        ids = rollout.prompt_ids + rollout.completion_ids + tool_suffix_ids(tokenizer, results)
        if len(ids) - len(rollout.prompt_ids) > budget or len(ids) >= context:
            del rollout.messages[before:]
            rollout.rolled_back += 1
            continue
        extended[i] = ids
    return extended
