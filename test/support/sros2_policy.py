"""An SROS2 policy file read as what each enclave may create, to hold it against the ROS graph.

This reads the policy format (version 0.2.0) the way sros2 turns it into DDS permissions, for the
subset the project's policy uses: ``xi:include`` of a profile's children
(``xpointer(/profile/*)``), ``~`` for the profile's node, names relative to the profile's
namespace, and ``<actions>`` (an action server creates three services and two topics under
``<action>/_action/``). Grants are fnmatch patterns, as in DDS permissions (``launch_ros_*``).

Entities are keyed by what the policy calls them: ``publish`` / ``subscribe`` (topics),
``reply`` / ``request`` (service servers / clients), ``execute`` / ``call`` (action servers /
clients).
"""
from __future__ import annotations

import fnmatch
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, FrozenSet, List, Set

XINCLUDE = "{http://www.w3.org/2001/XInclude}include"
PROFILE_CHILDREN = "xpointer(/profile/*)"
ACTION_SERVICES = ("send_goal", "cancel_goal", "get_result")
ACTION_TOPICS = ("feedback", "status")
#: For each list element of a profile, its qualifiers and the entity kind each one grants.
KINDS = {"topics": ("publish", "subscribe"), "services": ("reply", "request"), "actions": ("execute", "call")}
ENTITY_KINDS = ("publish", "subscribe", "reply", "request", "execute", "call")


@dataclass(frozen=True)
class Grants:
    """What one enclave may create: for each entity kind, the name patterns granted."""

    patterns: Dict[str, FrozenSet[str]]

    def allows(self, kind: str, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.patterns.get(kind, ()))


def resolve_includes(element: ET.Element, base: Path) -> None:
    """Replace each ``xi:include`` child of ``element`` (recursively) by the children of the
    ``<profile>`` it names, relative to ``base`` (the including file's folder)."""
    for index, child in reversed(list(enumerate(element))):
        if child.tag == XINCLUDE:
            assert child.get("xpointer") == PROFILE_CHILDREN, \
                f"{base}: an include must take {PROFILE_CHILDREN}, not {child.get('xpointer')}"
            path = base / child.attrib["href"]
            included = ET.parse(path).getroot()
            assert included.tag == "profile", f"{path}: its root is <{included.tag}>, not <profile>"
            resolve_includes(included, path.parent)
            element[index:index + 1] = list(included)
        else:
            resolve_includes(child, base)


def flattened(policy: Path, out: Path) -> Path:
    """``policy`` written to ``out`` with its includes resolved (the same rules, one file).

    What sros2 is given in the tests: with the lxml wheels of PyPI (5.x and 6.x, libxml2 2.12+),
    ``create_permission`` on a policy whose included profiles sit beside ``<actions>`` writes the
    permissions and then crashes at exit (SIGSEGV freeing the policy document); from one file it
    exits 0."""
    root = ET.parse(policy).getroot()
    resolve_includes(root, policy.parent)
    ET.ElementTree(root).write(out, encoding="UTF-8", xml_declaration=True)
    return out


def qualified(name: str, namespace: str, node: str) -> str:
    """A policy name as a ROS name: ``~`` is the node, a relative name lies in ``namespace``."""
    prefix = namespace.rstrip("/")
    if name.startswith("~"):
        return f"{prefix}/{node}{name[1:]}"
    return name if name.startswith("/") else f"{prefix}/{name}"


def action_parts(kind: str, action: str) -> Dict[str, Set[str]]:
    """The services and topics under an action's name that its server (``execute``) or client
    (``call``) creates, by entity kind."""
    services = {f"{action}/_action/{s}" for s in ACTION_SERVICES}
    topics = {f"{action}/_action/{t}" for t in ACTION_TOPICS}
    if kind == "execute":
        return {"execute": {action}, "reply": services, "publish": topics}
    return {"call": {action}, "request": services, "subscribe": topics}


def enclave_grants(policy: Path, enclave: str) -> Grants:
    """The grants of ``enclave`` in the policy file ``policy`` (includes resolved)."""
    root = ET.parse(policy).getroot()
    resolve_includes(root, policy.parent)
    matches = [e for e in root.iter("enclave") if e.get("path") == enclave]
    assert len(matches) == 1, f"{policy}: {len(matches)} enclaves {enclave}"
    granted: Dict[str, Set[str]] = {kind: set() for kind in ENTITY_KINDS}
    for profile in matches[0].iter("profile"):
        namespace, node = profile.attrib["ns"], profile.attrib["node"]
        for rules in profile:
            for qualifier in KINDS[rules.tag]:
                value = rules.get(qualifier)
                if value is None:
                    continue
                assert value == "ALLOW", f"{policy}: {enclave} has {qualifier}={value} (only ALLOW is read)"
                for item in rules:
                    name = qualified(item.text.strip(), namespace, node)
                    parts = action_parts(qualifier, name) if rules.tag == "actions" else {qualifier: {name}}
                    for kind, names in parts.items():
                        granted[kind] |= names
    return Grants({kind: frozenset(names) for kind, names in granted.items()})


def entities_of(probe, name: str, namespace: str = "/") -> Dict[str, Set[str]]:
    """Every topic, service and action the node ``namespace``/``name`` has created, as the ROS
    graph seen from the rclpy node ``probe`` tells it."""
    from rclpy.action import get_action_client_names_and_types_by_node, get_action_server_names_and_types_by_node

    def names(pairs) -> Set[str]:
        return {topic for topic, _types in pairs}
    return {
        "publish": names(probe.get_publisher_names_and_types_by_node(name, namespace)),
        "subscribe": names(probe.get_subscriber_names_and_types_by_node(name, namespace)),
        "reply": names(probe.get_service_names_and_types_by_node(name, namespace)),
        "request": names(probe.get_client_names_and_types_by_node(name, namespace)),
        "execute": names(get_action_server_names_and_types_by_node(probe, name, namespace)),
        "call": names(get_action_client_names_and_types_by_node(probe, name, namespace)),
    }


def settled_entities(probe, name: str, namespace: str = "/", timeout: float = 30.0) -> Dict[str, Set[str]]:
    """:func:`entities_of` once two looks 1 s apart agree (discovery has caught up)."""
    deadline = time.monotonic() + timeout
    last = entities_of(probe, name, namespace)
    while time.monotonic() < deadline:
        time.sleep(1.0)
        now = entities_of(probe, name, namespace)
        if now == last and any(now.values()):
            return now
        last = now
    raise AssertionError(f"the graph of {namespace}{name} did not settle within {timeout:.0f} s: {last}")


def ungranted(entities: Dict[str, Set[str]], grants: Grants) -> List[str]:
    """Each entity the grants do not allow, as ``"<kind> <name>"``, sorted."""
    return sorted(f"{kind} {name}" for kind, names in entities.items() for name in names
                  if not grants.allows(kind, name))
