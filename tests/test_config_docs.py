"""One home per config key: the schema describes every key, config.yaml stays a short file of values with pointers,
and docs/configuration.md's key table agrees with the schema."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from clemprm.config import DEFAULT_CONFIG_PATH, SCHEMA_PATH, validate_config

REPO = Path(__file__).resolve().parent.parent
CONFIGURATION_DOC = REPO / "docs" / "configuration.md"
MAX_CONFIG_BYTES = 12 * 1024


def schema_file() -> dict:
    """The schema as the file holds it (clemprm.config._schema replaces a few properties with the code's values)."""
    return yaml.safe_load(SCHEMA_PATH.read_text())


def properties(schema: dict, path: str = ""):
    """(dotted path, property schema) of every property under ``schema``: nested objects, the objects of ``oneOf``
    and ``anyOf`` alternatives, array items and ``additionalProperties`` schemas included."""
    if not isinstance(schema, dict):
        return
    for name, sub in schema.get("properties", {}).items():
        dotted = f"{path}.{name}" if path else name
        yield dotted, sub
        yield from properties(sub, dotted)
    for key in ("oneOf", "anyOf", "allOf"):
        for sub in schema.get(key, []):
            yield from properties(sub, path)
    for key, part in (("items", "[]"), ("additionalProperties", "*")):
        if isinstance(schema.get(key), dict):
            yield from properties(schema[key], f"{path}.{part}" if path else part)


def all_properties(schema: dict) -> list[tuple[str, dict]]:
    found = list(properties(schema))
    for name, definition in schema.get("$defs", {}).items():
        found += properties(definition, f"$defs.{name}")
    return found


def test_the_walk_finds_nested_properties():
    paths = {path for path, _ in all_properties(schema_file())}
    assert {"seed", "prm.gate.on_failure", "rl.lora.target_modules", "rl.prime.accuracy_filter",
            "merge.thresholds.max_kl", "$defs.model.spec", "$defs.vllm.url"} <= paths
    assert len(paths) > 200


def test_every_schema_property_has_a_description():
    missing = [path for path, sub in all_properties(schema_file())
               if not (isinstance(sub.get("description"), str) and sub["description"].strip())]
    assert not missing, (f"{len(missing)} propert{'y' if len(missing) == 1 else 'ies'} of {SCHEMA_PATH.name} without "
                         f"a description (one sentence: what it holds, its unit, what null means, its enum values): "
                         f"{', '.join(missing)}")


def test_config_yaml_stays_small():
    size = DEFAULT_CONFIG_PATH.stat().st_size
    assert size <= MAX_CONFIG_BYTES, (
        f"config.yaml is {size} bytes, above {MAX_CONFIG_BYTES}: a key's meaning belongs in its `description` in "
        f"{SCHEMA_PATH.name}, the reasoning behind a value in docs/configuration.md; config.yaml keeps at most one "
        f"short comment per key")


def test_config_yaml_comments_are_short():
    """At most one short comment line per key: a comment-only line is a group header or the file's introduction."""
    lines = DEFAULT_CONFIG_PATH.read_text().splitlines()
    long = [f"line {number}" for number, line in enumerate(lines, 1) if len(line) > 120]
    assert not long, f"config.yaml lines over 120 characters: {', '.join(long)}"
    body = [line for line in lines[next(i for i, line in enumerate(lines) if line and not line.startswith("#")):]]
    runs, run = [], 0
    for line in body:
        run = run + 1 if line.lstrip().startswith("#") else 0
        runs.append(run)
    assert max(runs, default=0) <= 1, ("config.yaml: a comment of several lines below its introduction: move the "
                                       "prose to the key's description in the schema or to docs/configuration.md")


def test_config_yaml_validates_against_the_schema():
    validate_config(yaml.safe_load(DEFAULT_CONFIG_PATH.read_text()))


def documented_keys() -> list[str]:
    """The keys of docs/configuration.md's "Keys" table, in order."""
    text = CONFIGURATION_DOC.read_text()
    assert "\n## Keys\n" in text, "docs/configuration.md has no '## Keys' section (the table of config sections)"
    table = text.split("\n## Keys\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([\w.]+)` \|", table, flags=re.MULTILINE)


def schema_key(schema: dict, dotted: str) -> bool:
    """Whether the dotted key is a property of the config schema (through $ref and oneOf alternatives)."""
    node = schema
    for part in dotted.split("."):
        if "$ref" in node:
            node = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]]
        candidates = [node, *node.get("oneOf", []), *node.get("anyOf", [])]
        found = next((c["properties"][part] for c in candidates if part in c.get("properties", {})), None)
        if found is None:
            return False
        node = found
    return True


def test_the_key_table_documents_every_section_of_the_schema():
    keys = documented_keys()
    assert keys, "docs/configuration.md's '## Keys' table has no rows (| `key` | what it holds | explained in |)"
    missing = [name for name in schema_file()["properties"] if name not in keys]
    assert not missing, (f"docs/configuration.md's '## Keys' table has no row for the config section(s) "
                         f"{', '.join(missing)} of {SCHEMA_PATH.name}")


def test_the_key_tables_name_only_keys_the_schema_has():
    """The '## Keys' table and the table 'What a changed key reruns'."""
    schema = schema_file()
    text = CONFIGURATION_DOC.read_text()
    reruns = text.split("### What a changed key reruns", 1)[1].split("\n#", 1)[0]
    keys = documented_keys() + re.findall(r"^\| `([\w.]+)` \|", reruns, flags=re.MULTILINE)
    unknown = [key for key in keys if not schema_key(schema, key)]
    assert not unknown, (f"docs/configuration.md names config key(s) that {SCHEMA_PATH.name} does not have: "
                         f"{', '.join(unknown)}")


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a Markdown file's headings."""
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", markdown, flags=re.MULTILINE):
        found.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("source", [DEFAULT_CONFIG_PATH, SCHEMA_PATH], ids=lambda path: path.name)
def test_the_docs_pointers_lead_to_a_section(source):
    """A pointer such as docs/stages.md#prm in config.yaml or a schema description names a heading that exists."""
    broken = []
    for page, anchor in sorted(set(re.findall(r"docs/([\w\-]+\.md)(?:#([\w\-]+))?", source.read_text()))):
        path = REPO / "docs" / page
        if not path.is_file():
            broken.append(f"docs/{page} (no such file)")
        elif anchor and anchor not in anchors(path.read_text()):
            broken.append(f"docs/{page}#{anchor} (no such heading)")
    assert not broken, f"{source.name} points at: {', '.join(broken)}"
