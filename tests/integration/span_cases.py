"""Extraction cases for span extraction (tests/integration/test_spans.py, loadtest/spans.py).

Each case is a source text (the user message), an instruction (the system
message) and a schema whose string leaves are spans. ``schema(case, span)``
gives the schema with or without ``x-span``, so the same request can be run
both ways.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Case:
    name: str
    source: str
    instruction: str
    fields: dict[str, str]  # property -> "string" | "array"

    def schema(self, span: bool) -> dict[str, Any]:
        leaf: dict[str, Any] = {"type": "string", "minLength": 1}
        if span:
            leaf["x-span"] = True
        properties: dict[str, Any] = {}
        for name, kind in self.fields.items():
            if kind == "array":
                properties[name] = {
                    "type": "array",
                    "items": copy.deepcopy(leaf),
                    "minItems": 1,
                    "maxItems": 3,
                }
            else:
                properties[name] = copy.deepcopy(leaf)
        return {
            "type": "object",
            "properties": properties,
            "required": list(self.fields),
            "additionalProperties": False,
        }

    def messages(self) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": self.instruction},
            {"role": "user", "content": self.source},
        ]


def _case(label: str, source: str, instruction: str, /, **fields: str) -> Case:
    return Case(label, source, instruction, fields)


S = "string"
A = "array"

CASES = [
    _case("person", "Maria Lopez was born in Seville in 1984.", "Extract the person.", name=S),
    _case(
        "city",
        "The conference moved from Berlin to Lisbon last spring.",
        "Where is it now?",
        city=S,
    ),
    _case(
        "date",
        "The contract was signed on 12 March 2021 by both parties.",
        "Give the date.",
        date=S,
    ),
    _case(
        "iso date", "Invoice INV-2291, issued 2023-11-05, due 2023-12-05.", "Issue date?", issued=S
    ),
    _case("amount", "Total due: $1,249.99 including tax.", "What is the total?", amount=S),
    _case("euro amount", "Die Miete beträgt 850 € pro Monat.", "Wie hoch ist die Miete?", rent=S),
    _case(
        "quote with quotes",
        'He said "we will ship on Friday" and left the room.',
        "What did he say, exactly?",
        quote=S,
    ),
    _case(
        "quote with newline",
        "The note read:\nMeet me at noon\nby the old bridge.",
        "What did the note read?",
        note=S,
    ),
    _case(
        "backslash path",
        "The log is written to C:\\logs\\app.txt every hour.",
        "Which file is the log?",
        path=S,
    ),
    _case("accents", "Le rendez-vous est chez François Dupré à Genève.", "Who hosts?", host=S),
    _case("japanese", "東京の会議は山田太郎さんが担当します。", "担当者は誰ですか？", person=S),  # noqa: RUF001
    _case("email", "Contact support at help@example.org for refunds.", "Email address?", email=S),
    _case("phone", "Call our office on +44 20 7946 0958 before 5pm.", "Phone number?", phone=S),
    _case(
        "name and age",
        "Tom Becker, aged 42, works as a carpenter in Ohio.",
        "Extract name and job.",
        name=S,
        job=S,
    ),
    _case(
        "three fields",
        "Flight BA117 departs London Heathrow at 08:25 for New York.",
        "Extract the flight.",
        flight=S,
        origin=S,
        time=S,
    ),
    _case(
        "product",
        "The UltraBlend 3000 blender costs 89 dollars and has a 2-year warranty.",
        "Extract product and warranty.",
        product=S,
        warranty=S,
    ),
    _case(
        "list of names",
        "Present at the meeting: Alice Chen, Bob Okafor and Carla Ruiz.",
        "Who was present?",
        names=A,
    ),
    _case(
        "list of fruits",
        "We bought apples, mangoes, and a pineapple at the market.",
        "What was bought?",
        items=A,
    ),
    _case(
        "list of dates",
        "Deadlines: 1 May for drafts, 15 June for reviews, 30 July for finals.",
        "List the deadlines.",
        dates=A,
    ),
    _case(
        "symptom",
        "The patient reports a sharp pain in the left knee since Monday.",
        "Symptom?",
        symptom=S,
    ),
    _case(
        "company",
        "Shares of Norvik Industries rose 4% after the merger.",
        "Which company?",
        company=S,
    ),
    _case("title", "Her novel, The Quiet Harbour, won the prize in 2019.", "Book title?", title=S),
    _case(
        "address",
        "Deliver to 221B Baker Street, London NW1 6XE.",
        "Delivery address?",
        street=S,
        postcode=S,
    ),
    _case("percent", "Unemployment fell to 3.7 percent in October.", "The rate?", rate=S),
    _case(
        "recipe",
        "Mix 200 g flour with 2 eggs and 100 ml milk, then rest for 30 minutes.",
        "Ingredients?",
        ingredients=A,
    ),
    _case(
        "tab separated",
        "id\tname\tscore\n7\tLena Park\t93",
        "Which student and score?",
        student=S,
        score=S,
    ),
    _case(
        "nested quote",
        'The sign says "No \\"parking\\" here" in red.',
        "What does the sign say?",
        sign=S,
    ),
    _case("russian", "Москва — столица России, там живёт Иван Петров.", "Кто там живёт?", person=S),
    _case(
        "speaker and quote",
        'At the summit, Dr. Amara Singh declared: "Clean water is a right."\nApplause followed.',
        "Who spoke and what was said?",
        speaker=S,
        quote=S,
    ),
    _case(
        "version", "Upgrade to version 2.14.3 to fix the memory leak.", "Which version?", version=S
    ),
    _case(
        "weather",
        "Tomorrow: cloudy, high of 18°C, winds from the northwest.",
        "The forecast?",
        sky=S,
        high=S,
    ),
    _case(
        "emoji",
        "Our café ☕ opens at 7:00 — pastries 🥐 from 8:00.",
        "Opening time?",
        opens=S,
    ),
]
