"""Tasks with checkable answers for the learned tiny M3 (issue 27): seeded generators, train and eval splits.

Five tasks, each a chat in M3's template with one exact answer:

- `arithmetic`: "What is A op B?" with op in + - *; A and B have 1-3 digits for + and - (A >= B for -, so no
  negative results); * multiplies a 1-2 digit number by a digit. Sizes a ~12M-parameter model reads digit by digit
  (the tokenizer splits digits) and can learn in minutes: at most 4 answer digits, carries over at most 3 positions.
- `retrieval`: a list of RETRIEVAL_PAIRS ` key value` pairs on one line (a random choice of key words, each with a
  random value word; one token each), then a question about one key; the answer quotes that key's pair
  (` key value`). The pairs are 512 tokens with the learned tokenizer (the prompt 619), 4x the span MSA selects
  (top-4 blocks of 32 = 128 tokens), so the indexer has to find the block that holds the key.
  Training contexts hold RETRIEVAL_TRAIN_MIN_PAIRS to RETRIEVAL_PAIRS pairs, log-uniformly (`retrieval_train_pairs`);
  the eval split always RETRIEVAL_PAIRS.
- `tool_call`: 1-3 tools given as JSON schemas (`tools=`), the answer one call in M3's tool-call markup with the
  arguments the user's message names.
- `reasoning`: a two-step word problem; thinking enabled, the answer is a short trace inside M3's think tags, then
  the number.
- `multi_turn`: 1-2 turns where the user states facts (the assistant acknowledges), then a question about one of
  them.

Every task but `reasoning` runs with thinking disabled. The answer text is what the chat template itself renders for
the assistant's reply (so training targets and the template never disagree), without the end-of-turn token.

Splits never overlap: each problem has a key (for arithmetic the operands, not the wording), and a stable hash of the
key puts it in the eval split (1 in EVAL_BUCKETS) or the train split (the rest); each split also draws from its own
seed stream.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import random
import zlib
from typing import Any

from m3serve.text.chat_template import render_chat_template
from m3serve.text.reasoning import extract
from m3serve.text.tiny_chat_template import TINY_M3_CHAT_TEMPLATE
from m3serve.text.tiny_tokenizer import EOS_TOKEN
from m3serve.text.tool_parser import parse_tool_calls

TASKS = ("arithmetic", "retrieval", "tool_call", "reasoning", "multi_turn")
SPLITS = ("train", "eval")
EVAL_BUCKETS = 8  # 1 in 8 problems is held out for eval
RETRIEVAL_PAIRS = 256  # eval contexts: 512 tokens of pairs, 4x the span MSA selects (the prompt ~4.8x)
RETRIEVAL_TRAIN_MIN_PAIRS = 2  # training contexts hold 2-256 pairs: a lookup is learned sooner among fewer keys
END_OF_TURN = EOS_TOKEN + "\n"  # what the template writes after an assistant reply

THINK_OFF = {"thinking_mode": "disabled"}
THINK_ON = {"thinking_mode": "enabled"}


@dataclasses.dataclass(frozen=True)
class Example:
    """One chat and the exact assistant text the model must produce (`answer`). `expected` is what `check` compares:
    the final answer string, or for tool_call the call {"name", "arguments"}. `chat_template_kwargs` hold
    thinking_mode; `tools` go to the template as `tools=` (through the engine: chat_template_kwargs["tools"])."""

    task: str
    messages: list[dict]
    tools: list[dict] | None
    chat_template_kwargs: dict
    answer: str
    key: str  # the problem's identity (which split it is in)
    expected: Any = dataclasses.field(repr=False)

    def check(self, generated_text: str) -> bool:
        """Exact match of a generated reply (special tokens kept; a trailing end-of-turn token is ignored)."""
        text = generated_text.removesuffix(EOS_TOKEN)
        _, content = extract(text, self.chat_template_kwargs.get("thinking_mode"))
        if self.task == "tool_call":
            rest, calls = parse_tool_calls(content, self.tools)
            return not rest.strip() and calls == [self.expected]
        return content == self.expected

    def reply_text(self, reply: dict) -> str:
        """The text the chat template renders for the assistant message `reply` ({"content", "reasoning_content",
        "tool_calls"} with the arguments an object) after this example's prompt: a parsed reply (an OpenAI-compatible
        server's) written back as the model's own text, for `check` and to compare with other paths' replies."""
        return _reply_text(self.messages, reply, self.tools, self.chat_template_kwargs)


def _reply_text(messages: list[dict], reply: dict, tools: list[dict] | None, kwargs: dict) -> str:
    """The text the chat template renders for `reply` after the generation prompt of `messages`."""
    prompt = render_chat_template(TINY_M3_CHAT_TEMPLATE, messages, tools=tools, add_generation_prompt=True,
                                  **kwargs)
    full = render_chat_template(TINY_M3_CHAT_TEMPLATE, messages + [reply], tools=tools,
                                add_generation_prompt=False, **kwargs)
    if not (full.startswith(prompt) and full.endswith(END_OF_TURN)):
        raise AssertionError("the chat template's reply does not extend its generation prompt")
    return full[len(prompt):-len(END_OF_TURN)]


def _example(task, messages, reply, expected, tools=None, kwargs=THINK_OFF) -> Example:
    return Example(task, messages, tools, dict(kwargs), _reply_text(messages, reply, tools, kwargs), "", expected)


# ---------------------------------------------------------------- arithmetic

def _arithmetic(rng: random.Random):
    op = rng.choice("+-*")
    if op == "*":  # a 1-2 digit number times a digit, in either order
        a, b = rng.randint(0, 10 ** rng.randint(1, 2) - 1), rng.randint(0, 9)
        if rng.random() < 0.5:
            a, b = b, a
    else:
        a, b = (rng.randint(0, 10 ** rng.randint(1, 3) - 1) for _ in range(2))
    if op == "-" and a < b:
        a, b = b, a
    result = {"+": a + b, "-": a - b, "*": a * b}[op]
    wording = rng.choice(["What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} = ?"])
    messages = [{"role": "user", "content": wording.format(a=a, op=op, b=b)}]
    return (op, a, b), lambda: _example("arithmetic", messages, {"role": "assistant", "content": str(result)},
                                        str(result))


# ---------------------------------------------------------------- retrieval

# keys and values are words (one token each with the learned tokenizer), written so that a word is the same token
# in the context, in the question and in the answer: each pair is " key value", the key with its space as after
# "for " in the question, the value with its space as in the reply (which starts with the key's space). The list is
# one line of such pairs.
# (Random 4-letter keys with 4-digit values made the model copy multi-token keys and digit strings whose tokens
# recur all over the context; no run learned that in the time of a device call, docs/quality.md.)
_KEY_WORDS = tuple("""
acorn anchor arrow badge banjo barrel basket beacon bishop blanket bottle bracket bridge bucket button cabin camel
candle canyon carpet castle cellar chimney circus clover cobalt comet copper corner cottage crater crystal dagger
desert dolphin dragon drum eagle ember falcon feather fiddle forest fossil fountain galaxy garden geyser glacier
goblet granite gravel hammer harbor harp hazel helmet hermit honey island ivory jacket jasper jungle kettle kitten
ladder lantern lemon lizard locket magnet mango marble meadow mirror mitten monkey mosaic nectar needle oasis
orchid otter paddle palace panther parrot pebble pepper pillow pirate planet pocket pond puzzle quartz quill rabbit
radish raven ribbon rocket saddle salmon satin shovel silver sparrow spider spiral stable summit tablet teapot
temple thunder ticket tiger timber tulip tunnel turtle velvet violin walnut wagon willow window wizard yarn zebra
apron attic awning bamboo barley beetle biscuit blossom boulder bramble breeze buckle cactus canoe cargo cedar cherry
cider cobweb compass cricket cushion daisy donkey easel elbow engine ferret flute fortress gadget garlic goose gutter
hatchet hedge iceberg igloo jigsaw juniper kayak kernel koala lagoon lobster maple mussel napkin nugget oyster
acrobat almond antler apricot artist avocado ballet balloon bandit beaver bison blender bonnet bouquet bubble
buffalo bugle cabbage canary cannon carrot cashew cello chariot cheetah chess chisel cinema cliff cloak cocoa coconut
collar cookie crayon crown cupboard curtain dentist diamond dinosaur domino doorbell dune fence ferry flamingo frog
gazelle giraffe glove gondola gorilla guitar hamster hedgehog hippo hornet hotel jaguar kangaroo kitchen lettuce
library lighthouse llama mammoth meteor moose muffin mushroom nest notebook octopus onion orbit ostrich owl pancake
papaya peacock pelican penguin piano pickle pigeon pumpkin raccoon rhino robot sandal scarf scooter skunk sled snail
sock squirrel statue swan tractor trumpet tuba umbrella unicorn volcano waffle walrus whistle yacht yogurt
""".split())
_VALUE_WORDS = tuple("""
red blue green gold gray pink black white brown amber azure beige coral cream crimson cyan ebony indigo jade khaki
lilac lime maroon mint navy ochre olive orange peach plum rose ruby rust sage sand scarlet sepia slate steel tan
teal topaz umber violet wheat
""".split())
_CODE_QUESTION = "What is the code for {}?"


def _retrieval(rng: random.Random, pairs: int = RETRIEVAL_PAIRS):
    keys = rng.sample(_KEY_WORDS, pairs)
    values = [rng.choice(_VALUE_WORDS) for _ in keys]
    q = rng.randrange(len(keys))
    text = f"Here is a list of codes.\n{pairs_text(zip(keys, values))}\n" + _CODE_QUESTION.format(keys[q])
    messages = [{"role": "user", "content": text}]
    reply = _quoted(keys[q], values[q])
    return text, lambda: _example("retrieval", messages, {"role": "assistant", "content": reply}, reply)


def retrieval_train_pairs(rng: random.Random, hi: int = RETRIEVAL_PAIRS) -> int:
    """The pairs of one training context, log-uniform over RETRIEVAL_TRAIN_MIN_PAIRS..`hi` (default RETRIEVAL_PAIRS):
    half the contexts hold at most ~23 pairs, where the lookup is easiest to learn (1 of 2-23 keys to match), and the
    rest reach the eval's length. (Uniform over 8-112, most contexts were long; three H200 runs left retrieval at
    chance.) A smaller `hi` makes the short contexts of the training's retrieval-first phase (train.py)."""
    lo = RETRIEVAL_TRAIN_MIN_PAIRS
    if not lo <= hi <= RETRIEVAL_PAIRS:
        raise ValueError(f"retrieval contexts hold {lo}-{RETRIEVAL_PAIRS} pairs, got at most {hi}")
    return min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1)))))


def _quoted(key: str, value: str) -> str:
    """A context pair, and a retrieval reply quoting the asked key's pair (" key value"): the same tokens in both.
    Where the reply was the value alone, the model had to carry the key from the question, eight tokens back, to the
    answer position and match it there; no H200 run learned that. Quoting the line puts the key right before the
    value, the next-token copy an induction head does (two layers: one marks each token with the one before it, one
    matches on that mark). With a colon between key and value (" key:value", until 2026-12-05) the copy took a third
    hop, and a micro model learned it several times slower; with a newline after every pair (also until
    2026-12-05) a micro model had not learned it by step 1,400, where it took 750-850 without (docs/quality.md), so
    the pairs follow each other on one line: " k1 v1 k2 v2 ..." (keys and values are drawn from disjoint words)."""
    return f" {key} {value}"


def pairs_text(pairs) -> str:
    """The list's line: its (key, value) pairs one after another, each as `_quoted` writes it."""
    return "".join(_quoted(k, v) for k, v in pairs)


def context_pairs(example: Example) -> list[tuple[str, str]]:
    """A retrieval example's context as (key, value) pairs, in order (the line between the heading and the
    question)."""
    words = example.messages[0]["content"].split("\n")[1].split()
    return list(zip(words[::2], words[1::2]))


def retrieval_follow_ups(example: Example, n: int, rng: random.Random) -> list[tuple[str, str]]:
    """`n` more (question, answer) turns about other keys of a retrieval example's context (training rows ask
    several questions per context: one long context, several answers to learn from)."""
    asked = example.messages[0]["content"].rsplit(" ", 1)[-1].rstrip("?")
    others = [(k, v) for k, v in context_pairs(example) if k != asked]
    return [(_CODE_QUESTION.format(k), _quoted(k, v)) for k, v in rng.sample(others, min(n, len(others)))]


_RECITE = "Repeat the codes."


def retrieval_recital(example: Example, rng: random.Random) -> tuple[list[dict], list[tuple[str, str]]]:
    """A recital of a retrieval example's context, for the training's retrieval-first phase: (messages, pairs) where
    the user gives the list and asks for it back (no question about one key) and the reply is as many of its
    (key, value) pairs as it has, each drawn at random with replacement (render.recital_row puts the loss on the
    values only). Each key then occurs once before the value it must recall, as in the context; in a question
    turn it occurs twice (in its line and in the question), and on the CPU that extra occurrence kept the lookup from
    forming while a model that had learned it on plain lines answered questions at once
    (benchmarks/recall_plateau.py --question, docs/quality.md). With replacement, because a recital of every pair
    once in a shuffled order can be half right without any lookup: the values not yet recited narrow the choice,
    and the last is certain (an H100 run, 2026-12-05, plateaued at 0.45-0.49, what that elimination gives)."""
    head = example.messages[0]["content"].rsplit("\n", 1)[0]
    pairs = context_pairs(example)
    return [{"role": "user", "content": f"{head}\n{_RECITE}"}], [rng.choice(pairs) for _ in pairs]


# ---------------------------------------------------------------- tool_call

def _tool(name: str, description: str, props: dict[str, str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": {k: {"type": t} for k, t in props.items()},
                       "required": list(props)}}}


_CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Delhi", "Rome", "Seoul", "Quito", "Dakar", "Perth", "Miami",
           "Berlin", "Madrid", "Nairobi", "Toronto", "Hanoi", "Prague", "Dublin", "Havana"]
_CURRENCIES = ["USD", "EUR", "JPY", "GBP", "CHF", "CAD", "INR", "BRL", "KRW", "MXN"]
_LABELS = ["tea", "pasta", "laundry", "workout", "meeting", "nap", "bread", "eggs", "study", "call"]
_PLACES = ["Luigi's", "Blue Moon", "Sakura", "El Toro", "The Oak", "Spice Hut", "Le Coq", "Green Leaf"]
_PHRASES = ["good morning", "thank you", "where is the station", "I am hungry", "see you soon", "how much is it"]
_LANGUAGES = ["French", "German", "Spanish", "Italian", "Japanese", "Korean", "Dutch", "Polish"]

_TOOLS = [
    (_tool("get_weather", "Get the weather forecast for a city", {"city": "string", "days": "integer"}),
     lambda r: {"city": r.choice(_CITIES), "days": r.randint(1, 14)},
     ["What is the weather in {city} for the next {days} days?", "Forecast for {city}, {days} days please."]),
    (_tool("convert_currency", "Convert an amount of money",
           {"amount": "integer", "from_currency": "string", "to_currency": "string"}),
     lambda r: dict(zip(("amount", "from_currency", "to_currency"),
                        [r.randint(1, 9999), *r.sample(_CURRENCIES, 2)])),
     ["Convert {amount} {from_currency} to {to_currency}.", "How much is {amount} {from_currency} in {to_currency}?"]),
    (_tool("set_timer", "Start a named timer", {"minutes": "integer", "label": "string"}),
     lambda r: {"minutes": r.randint(1, 120), "label": r.choice(_LABELS)},
     ["Set a timer for {minutes} minutes called {label}.", "Timer named {label}, {minutes} minutes."]),
    (_tool("book_table", "Book a restaurant table", {"restaurant": "string", "people": "integer", "time": "string"}),
     lambda r: {"restaurant": r.choice(_PLACES), "people": r.randint(1, 12),
                "time": f"{r.randint(11, 22)}:{r.choice(['00', '15', '30', '45'])}"},
     ["Book a table at {restaurant} for {people} people at {time}.",
      "Reserve {restaurant} at {time}, we are {people}."]),
    (_tool("translate", "Translate a phrase", {"text": "string", "target_language": "string"}),
     lambda r: {"text": r.choice(_PHRASES), "target_language": r.choice(_LANGUAGES)},
     ["Translate \"{text}\" into {target_language}.", "How do you say \"{text}\" in {target_language}?"]),
]


def tool_schemas() -> list[dict]:
    """Every tool the tool_call task offers (JSON schemas in the OpenAI `tools` format)."""
    return [copy.deepcopy(t[0]) for t in _TOOLS]


def _tool_call(rng: random.Random):
    chosen = rng.sample(range(len(_TOOLS)), rng.randint(1, 3))
    tool, make_args, wordings = _TOOLS[chosen[0]]
    args = make_args(rng)
    tools = [_TOOLS[i][0] for i in rng.sample(chosen, len(chosen))]
    name = tool["function"]["name"]
    messages = [{"role": "user", "content": rng.choice(wordings).format(**args)}]
    reply = {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {
        "name": name, "arguments": args}}]}
    key = json.dumps([name, args], sort_keys=True)
    return key, lambda: _example("tool_call", messages, reply, {"name": name, "arguments": args}, tools=tools)


# ---------------------------------------------------------------- reasoning

_NAMES = ["Ann", "Ben", "Cara", "Dan", "Eva", "Finn", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena", "Max", "Nora",
          "Omar", "Pia", "Raj", "Sara", "Tom", "Uma", "Vic", "Wes", "Yara", "Zoe"]
_ITEMS = ["apples", "pens", "books", "coins", "cards", "stamps", "shells", "marbles", "cookies", "stickers"]


def _reasoning(rng: random.Random):
    kind = rng.randrange(3)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if kind == 0:
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        c = rng.randint(1, a + b)
        s, r = a + b, a + b - c
        q = f"{name} has {a} {item}, buys {b} more, then gives away {c}. How many {item} does {name} have now?"
        thought = f"{a} + {b} = {s}. {s} - {c} = {r}."
    elif kind == 1:
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 20)
        s, r = a * b, a * b + c
        q = f"{name} has {a} boxes of {b} {item} and {c} loose {item}. How many {item} is that in all?"
        thought = f"{a} * {b} = {s}. {s} + {c} = {r}."
    else:
        a = rng.randint(2, 50)
        b, c = rng.randint(1, a), rng.randint(1, 50)
        s, r = a - b, a - b + c
        q = f"{name} had {a} {item}, lost {b}, then found {c}. How many {item} does {name} have?"
        thought = f"{a} - {b} = {s}. {s} + {c} = {r}."
    messages = [{"role": "user", "content": q}]
    reply = {"role": "assistant", "content": str(r), "reasoning_content": thought}
    return (kind, a, b, c), lambda: _example("reasoning", messages, reply, str(r), kwargs=THINK_ON)


# ---------------------------------------------------------------- multi_turn

_COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "black", "white", "pink", "brown"]
_PETS = ["Rex", "Luna", "Milo", "Bella", "Coco", "Max", "Daisy", "Oscar", "Ruby", "Leo"]
_FACTS = [  # statement, question, value
    ("My favourite color is {}.", "What is my favourite color?", lambda r: r.choice(_COLORS)),
    ("My dog is called {}.", "What is my dog called?", lambda r: r.choice(_PETS)),
    ("I live in {}.", "Which city do I live in?", lambda r: r.choice(_CITIES)),
    ("My locker number is {}.", "What is my locker number?", lambda r: str(r.randint(100, 999))),
    ("My sister's name is {}.", "What is my sister's name?", lambda r: r.choice(_NAMES)),
]
_ACKS = ["Got it.", "Noted.", "OK, I will remember that."]


def _multi_turn(rng: random.Random):
    facts = rng.sample(range(len(_FACTS)), rng.randint(1, 2))
    values = {f: _FACTS[f][2](rng) for f in facts}
    messages: list[dict] = []
    for f in facts:
        messages += [{"role": "user", "content": _FACTS[f][0].format(values[f])},
                     {"role": "assistant", "content": rng.choice(_ACKS)}]
    asked = rng.choice(facts)
    messages.append({"role": "user", "content": _FACTS[asked][1]})
    key = json.dumps([sorted(values.items()), asked])
    return key, lambda: _example("multi_turn", messages, {"role": "assistant", "content": values[asked]},
                                 values[asked])


_GENERATORS = {"arithmetic": _arithmetic, "retrieval": _retrieval, "tool_call": _tool_call, "reasoning": _reasoning,
               "multi_turn": _multi_turn}


def split_of(task: str, key) -> str:
    """The split a problem belongs to, from a stable hash of its key."""
    h = zlib.crc32(f"{task}|{key}".encode())
    return "eval" if h % EVAL_BUCKETS == 0 else "train"


def make_examples(task: str, split: str, n: int, seed: int = 0, max_pairs: int = 0, pairs: int = 0
                  ) -> list[Example]:
    """`n` examples of `task` from `split` ("train" or "eval"), deterministic in its arguments.
    `max_pairs` (retrieval's train split only; 0: RETRIEVAL_PAIRS): its contexts hold at most that many pairs.
    `pairs` (retrieval's eval split only; 0: RETRIEVAL_PAIRS): its contexts hold that many (probes of the lookup at
    shorter lengths)."""
    if max_pairs and not (task == "retrieval" and split == "train"):
        raise ValueError(f"max_pairs is for retrieval's train split, not {task!r} {split!r}")
    if pairs and not (task == "retrieval" and split == "eval"):
        raise ValueError(f"pairs is for retrieval's eval split, not {task!r} {split!r}")
    if pairs and not RETRIEVAL_TRAIN_MIN_PAIRS <= pairs <= RETRIEVAL_PAIRS:
        raise ValueError(f"retrieval contexts hold {RETRIEVAL_TRAIN_MIN_PAIRS}-{RETRIEVAL_PAIRS} pairs, got {pairs}")
    if task not in _GENERATORS:
        raise ValueError(f"unknown task {task!r}; one of {TASKS}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; one of {SPLITS}")
    rng = random.Random(f"m3serve-learn|{task}|{split}|{seed}")
    out: list[Example] = []
    while len(out) < n:
        if task == "retrieval" and split == "train":  # contexts of every length up to the eval's
            key, build = _retrieval(rng, retrieval_train_pairs(rng, max_pairs or RETRIEVAL_PAIRS))
        elif task == "retrieval":
            key, build = _retrieval(rng, pairs or RETRIEVAL_PAIRS)
        else:
            key, build = _GENERATORS[task](rng)
        if split_of(task, key) == split:
            out.append(dataclasses.replace(build(), key=str(key)))
    return out
