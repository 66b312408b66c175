"""An example as a training row: the prompt the engine's chat-template path builds, then the answer and the
end-of-turn token the engine stops on; the loss mask covers only the target."""
from __future__ import annotations

import random

from m3serve.learn.tasks import THINK_OFF, Example, context_pairs, pairs_text, retrieval_recital


def prompt_ids(example: Example, tokenizer) -> list[int]:
    """The chat template with add_generation_prompt=True, tokenized (what `LLMEngine.prepare_request` builds from
    the same messages, tools and chat_template_kwargs)."""
    return tokenizer.apply_chat_template(example.messages, tools=example.tools, add_generation_prompt=True,
                                         tokenize=True, **example.chat_template_kwargs)


def render(example: Example, tokenizer) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask): prompt + answer + eos; loss_mask is 1 on the answer and the eos token.
    `tokenizer` is m3serve.text.tokenizer.Tokenizer."""
    if tokenizer.eos_token_id is None:
        raise ValueError("the tokenizer has no eos token")
    prompt = prompt_ids(example, tokenizer)
    target = tokenizer.encode(example.answer) + [tokenizer.eos_token_id]
    return prompt + target, [0] * len(prompt) + [1] * len(target)


def render_turns(first: Example, turns: list[tuple[str, str]], tokenizer) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a chat that goes on after `first`'s answer with more (user text, answer) turns of
    the same task (training rows with several problems: the loss on every answer). Each turn's prompt is the chat
    template over the conversation so far; a turn whose prompt does not extend the row ends it there (a template
    that re-renders history), so every prompt in a row is exactly what the engine would build. Only for tasks whose
    answer is the reply's content (thinking disabled).

    A turn's prompt is the row so far plus its new text tokenized alone: the row ends on the end-of-turn token, a
    special token, which the tokenizer splits off before anything merges. One tokenization of the whole last prompt
    checks that; where the row's text is not what this predicts, it is built again tokenizing every prompt whole (which
    costs the row's length per turn)."""
    ids, mask = render(first, tokenizer)
    kwargs = dict(tools=first.tools, add_generation_prompt=True, **first.chat_template_kwargs)
    messages = list(first.messages) + [{"role": "assistant", "content": first.answer}]
    text = tokenizer.apply_chat_template(first.messages, **kwargs) + first.answer + tokenizer.eos_token
    whole = None  # the last prompt's text
    for user, answer in turns:
        messages.append({"role": "user", "content": user})
        prompt_text = tokenizer.apply_chat_template(messages, **kwargs)
        if not prompt_text.startswith(text):  # a template that re-renders history, or a text we mispredicted
            return _render_turns_whole(first, turns, tokenizer)
        prompt = ids + tokenizer.encode(prompt_text[len(text):])
        ids, mask = _answered(ids, mask, prompt, answer, tokenizer)
        whole = (prompt_text, len(prompt))
        text = prompt_text + answer + tokenizer.eos_token
        messages.append({"role": "assistant", "content": answer})
    if whole is not None and tokenizer.encode(whole[0]) != ids[:whole[1]]:
        return _render_turns_whole(first, turns, tokenizer)
    return ids, mask


def _render_turns_whole(first: Example, turns: list[tuple[str, str]], tokenizer) -> tuple[list[int], list[int]]:
    """render_turns with every prompt tokenized whole (a template or tokenizer where the row's text does not split
    at the end-of-turn token)."""
    ids, mask = render(first, tokenizer)
    messages = list(first.messages) + [{"role": "assistant", "content": first.answer}]
    for user, answer in turns:
        messages.append({"role": "user", "content": user})
        prompt = tokenizer.apply_chat_template(messages, tools=first.tools, add_generation_prompt=True,
                                               tokenize=True, **first.chat_template_kwargs)
        if prompt[:len(ids)] != ids:
            break
        ids, mask = _answered(ids, mask, prompt, answer, tokenizer)
        messages.append({"role": "assistant", "content": answer})
    return ids, mask


def _answered(ids: list[int], mask: list[int], prompt: list[int], answer: str, tokenizer
              ) -> tuple[list[int], list[int]]:
    """The row `ids` (loss `mask`) grown to `prompt` (which extends it) plus `answer` and the end-of-turn token, the
    loss on those."""
    target = tokenizer.encode(answer) + [tokenizer.eos_token_id]
    return prompt + target, mask + [0] * (len(prompt) - len(ids)) + [1] * len(target)


def recital_row(example: Example, rng: random.Random, tokenizer, plain: bool) -> tuple[list[int], list[int]]:
    """(input_ids, loss_mask) of a recital of a retrieval example (tasks.retrieval_recital, drawn with `rng`): the
    chat template's conversation (the user's list, then "Repeat the codes.", thinking disabled), or where `plain` no
    template at all: BOS, the list's pairs, a newline, the recital (a pretraining-style row: nothing before the list
    but BOS). The reply's pairs " key value" follow each other as the list writes them, then the end-of-turn token;
    the loss is on the value tokens only (the keys come in an arbitrary order: nothing to learn from them). The reply
    is tokenized piece by piece to know which tokens are values; with the learned tokenizer that is the whole row's
    own tokenization (tests)."""
    messages, recited = retrieval_recital(example, rng)
    if plain:
        listed = pairs_text(context_pairs(example))
        prompt = [tokenizer.bos_token_id] + tokenizer.encode(listed) + tokenizer.encode("\n")
    else:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **THINK_OFF)
    ids, mask = list(prompt), [0] * len(prompt)
    for key, value in recited:
        for text, loss in ((f" {key}", 0), (f" {value}", 1)):
            piece = tokenizer.encode(text)
            ids += piece
            mask += [loss] * len(piece)
    return ids + [tokenizer.eos_token_id], mask + [0]
