"""Seeded, reproducible workloads: each is a list of conversations (a system prompt and user
turns); single-turn workloads are conversations of one turn."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

_WORDS = ("alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river mountain "
          "valley forest ocean desert city harbor bridge tower garden market engine kernel "
          "cache block token router replica prefix decode extend prefill latency budget").split()


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


@dataclass
class Conversation:
    system: str
    turns: list[str]
    session: str
    max_tokens: int = 16


@dataclass
class Workload:
    name: str
    conversations: list[Conversation] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)


def shared_prefix(groups: int = 4, prompts_per_group: int = 8, system_words: int = 300,
                  question_words: int = 20, max_tokens: int = 16, seed: int = 0) -> Workload:
    """SGLang's generated-shared-prefix: groups share a long system prompt; each prompt in a
    group adds its own question. Requests are interleaved across groups."""
    rng = random.Random(seed)
    systems = [f"Group {g} instructions: " + _text(rng, system_words) for g in range(groups)]
    convs = [Conversation(systems[g], [f"Question {p}: " + _text(rng, question_words)],
                          f"g{g}-p{p}", max_tokens)
             for p in range(prompts_per_group) for g in range(groups)]
    return Workload("shared_prefix", convs)


def multi_turn(conversations: int = 8, turns: int = 4, shared_systems: int = 2,
               system_words: int = 200, user_words: int = 25, max_tokens: int = 16,
               seed: int = 0) -> Workload:
    """Chat sessions whose history grows each turn; a few system prompts are shared."""
    rng = random.Random(seed)
    systems = [f"You are assistant #{s}. Rules: " + _text(rng, system_words)
               for s in range(shared_systems)]
    return Workload("multi_turn", _sessions(rng, systems, conversations, turns, "Turn",
                                            user_words, "conv-{i}", max_tokens))


def _sessions(rng: random.Random, heads: list[str], count: int, turns: int, label: str,
              words: int, session: str, max_tokens: int) -> list[Conversation]:
    """`count` conversations over shared heads (conversation i starts with head i mod n),
    each turn `label` + `words` random words; `session` is formatted with i and the head."""
    return [Conversation(heads[i % len(heads)],
                         [f"{label} {t}: " + _text(rng, words) for t in range(turns)],
                         session.format(i=i, head=i % len(heads)), max_tokens)
            for i in range(count)]


def doc_chat(conversations: int = 16, turns: int = 4, doc_words: int = 500,
             user_words: int = 60, max_tokens: int = 32, seed: int = 0) -> Workload:
    """Multi-turn chats that each carry a long document of their own (a contract, a code
    file, meeting notes): nothing is shared between conversations, so every hit comes from
    keeping a conversation where its history is."""
    rng = random.Random(seed)
    convs = [Conversation(f"Conversation {c}. Work only from these notes:\n"
                          + _text(rng, doc_words),
                          [f"Turn {t}: " + _text(rng, user_words) for t in range(turns)],
                          f"doc-{c}", max_tokens)
             for c in range(conversations)]
    return Workload("doc_chat", convs)


def agent_loop(agents: int = 4, sessions: int = 32, turns: int = 6,
               tool_prompt_words: int = 1200, result_words: int = 60, max_tokens: int = 32,
               seed: int = 0) -> Workload:
    """Agent sessions: a few agents, each with a long tool-and-instructions prompt shared by
    its sessions; every turn appends a short tool result to a growing history."""
    rng = random.Random(seed)
    prompts = [f"Agent {a}. Tools and rules: " + _text(rng, tool_prompt_words)
               for a in range(agents)]
    return Workload("agent_loop", _sessions(rng, prompts, sessions, turns, "Tool result",
                                            result_words, "agent{head}-s{i}", max_tokens))


def long_doc_qa(documents: int = 3, questions_per_doc: int = 10, doc_words: int = 900,
                question_words: int = 15, max_tokens: int = 16, seed: int = 0) -> Workload:
    """A few long documents, many questions about each (questions of one document interleave
    with the others')."""
    rng = random.Random(seed)
    docs = [f"Document {d}:\n" + _text(rng, doc_words) for d in range(documents)]
    convs = [Conversation(f"Answer from this document only.\n{docs[d]}",
                          [f"Question {q}: " + _text(rng, question_words)], f"doc{d}-q{q}",
                          max_tokens)
             for q in range(questions_per_doc) for d in range(documents)]
    return Workload("long_doc_qa", convs)


def mix(seed: int = 0) -> Workload:
    """Shared-prefix, multi-turn and long-document requests interleaved in one trace."""
    parts = [shared_prefix(groups=3, prompts_per_group=6, seed=seed),
             multi_turn(conversations=6, turns=3, seed=seed + 1),
             long_doc_qa(documents=2, questions_per_doc=6, seed=seed + 2)]
    rng = random.Random(seed)
    convs = [c for p in parts for c in p.conversations]
    rng.shuffle(convs)
    return Workload("mix", convs)


WORKLOADS = {"shared_prefix": shared_prefix, "multi_turn": multi_turn, "doc_chat": doc_chat,
             "agent_loop": agent_loop,
             "long_doc_qa": long_doc_qa, "mix": mix}
