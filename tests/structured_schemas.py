"""JSON schemas, regexes and choices that structured-output tests send to a real model.

Each schema is bounded (string lengths, array sizes, number ranges) so a
small model reaches the end of the document within the token budget. Paired
with a prompt asking for that kind of data.
"""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 24}

SCHEMAS: list[tuple[str, dict]] = [
    ("A person named Ann who is 31.", {
        "type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
        "required": ["name", "age"], "additionalProperties": False}),
    ("A city and its country.", {
        "type": "object", "properties": {"city": NAME, "country": NAME}, "required": ["city", "country"]}),
    ("The weather today.", {
        "type": "object", "properties": {
            "condition": {"type": "string", "enum": ["sunny", "cloudy", "rainy", "snowy"]},
            "celsius": {"type": "number", "minimum": -60, "maximum": 60}},
        "required": ["condition", "celsius"], "additionalProperties": False}),
    ("Three colors.", {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
                       "minItems": 3, "maxItems": 3}),
    ("A book with its author and year.", {
        "type": "object", "properties": {"title": NAME, "author": NAME,
                                         "year": {"type": "integer", "minimum": 1400, "maximum": 2030}},
        "required": ["title", "author", "year"], "additionalProperties": False}),
    ("Is water wet? Answer with a boolean and a reason.", {
        "type": "object", "properties": {"answer": {"type": "boolean"}, "reason": {"type": "string", "maxLength": 60}},
        "required": ["answer", "reason"], "additionalProperties": False}),
    ("A product with a price and a SKU code.", {
        "type": "object", "properties": {
            "name": NAME, "price": {"type": "number", "exclusiveMinimum": 0, "maximum": 10000},
            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}},
        "required": ["name", "price", "sku"], "additionalProperties": False}),
    ("A user with an address.", {
        "type": "object", "properties": {
            "user": NAME,
            "address": {"type": "object", "properties": {"street": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["street", "zip"], "additionalProperties": False}},
        "required": ["user", "address"], "additionalProperties": False}),
    ("A list of two tasks with priorities.", {
        "type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "object", "properties": {"task": NAME, "priority": {"type": "integer", "minimum": 1, "maximum": 5}},
            "required": ["task", "priority"], "additionalProperties": False}}),
    ("A date.", {"type": "object", "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
                 "required": ["date"], "additionalProperties": False}),
    ("An HTTP status.", {"type": "object", "properties": {
        "code": {"type": "integer", "enum": [200, 301, 404, 500]}, "message": {"type": "string", "maxLength": 30}},
        "required": ["code", "message"], "additionalProperties": False}),
    ("A rating out of five stars.", {"type": "integer", "minimum": 1, "maximum": 5}),
    ("A greeting.", {"type": "string", "maxLength": 40}),
    ("A point in 3D space.", {"type": "object", "properties": {
        "x": {"type": "number", "minimum": -100, "maximum": 100}, "y": {"type": "number", "minimum": -100, "maximum": 100},
        "z": {"type": "number", "minimum": -100, "maximum": 100}}, "required": ["x", "y", "z"], "additionalProperties": False}),
    ("A pet that is a cat or a dog.", {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
         "required": ["kind", "lives"], "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "dog"}, "breed": NAME},
         "required": ["kind", "breed"], "additionalProperties": False}]}),
    ("A shopping list with quantities.", {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {
            "name": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 20}}, "required": ["name", "qty"],
            "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False}),
    ("An email contact.", {"type": "object", "properties": {
        "name": NAME, "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"}},
        "required": ["name", "email"], "additionalProperties": False}),
    ("A movie with genres.", {"type": "object", "properties": {
        "title": NAME, "genres": {"type": "array", "minItems": 1, "maxItems": 3,
                                  "items": {"type": "string", "enum": ["drama", "comedy", "action", "horror"]}}},
        "required": ["title", "genres"], "additionalProperties": False}),
    ("A temperature reading that may be missing.", {"type": "object", "properties": {
        "sensor": NAME, "value": {"type": ["number", "null"], "minimum": -50, "maximum": 150}},
        "required": ["sensor", "value"], "additionalProperties": False}),
    ("A team of people with roles.", {"type": "object", "properties": {
        "team": NAME, "members": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
            "type": "object", "properties": {"name": NAME, "role": {"type": "string", "enum": ["lead", "dev", "qa"]}},
            "required": ["name", "role"], "additionalProperties": False}}},
        "required": ["team", "members"], "additionalProperties": False}),
    ("A fraction.", {"type": "object", "properties": {
        "numerator": {"type": "integer", "minimum": -1000, "maximum": 1000},
        "denominator": {"type": "integer", "minimum": 1, "maximum": 1000}},
        "required": ["numerator", "denominator"], "additionalProperties": False}),
    ("A color in hex.", {"type": "object", "properties": {"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
                         "required": ["hex"], "additionalProperties": False}),
    ("A yes/no survey answer with an optional comment.", {"type": "object", "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]}, "comment": {"type": "string", "maxLength": 40}},
        "required": ["answer"], "additionalProperties": False}),
]

REGEXES: list[tuple[str, str]] = [
    ("My phone number is", r"\(\d{3}\) \d{3}-\d{4}"),
    ("The IP address of the server is", r"(25[0-5]|2[0-4]\d|1?\d?\d)(\.(25[0-5]|2[0-4]\d|1?\d?\d)){3}"),
    ("Today's date:", r"20\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"),
]

CHOICES: list[tuple[str, list[str]]] = [
    ("Is the sky blue? Answer:", ["yes", "no"]),
    ("The best pet is a", ["cat", "dog", "fish", "parrot"]),
]


# Two tools for tool-calling tests on tiny models (enums keep a random model's arguments short).
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
TIME = {"type": "object", "additionalProperties": False, "required": ["zone"],
        "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
