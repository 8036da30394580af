"""Pure checks: facts by rank (and the filesystem measurements) -> problems.

A problem is ``{"check", "ranks", "detail", "fix"}``: which check fired, the ranks at fault
(the ones that differ from the majority; ties go to the group holding the lowest rank, so
the master's side counts as right), what was seen, and what to do. Nothing here touches the
machine: the facts are plain dicts (see :mod:`orchestrator.node.facts`), so every check is
unit-tested with hand-made facts.
"""

from __future__ import annotations

import ipaddress
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from orchestrator import defaults
from orchestrator.node.facts import reachable_addresses

GIB = 1024**3


@dataclass(frozen=True, slots=True)
class Thresholds:
    min_free_bytes: int = 10 * GIB
    max_clock_skew_s: float = 2.0
    node_timeout_s: float = defaults.NODE_TIMEOUT_S  # coordination.node_timeout_s the run will use
    visibility_fraction: float = 0.25  # flag filesystem visibility beyond this share of the node timeout

    @property
    def max_visibility_s(self) -> float:
        return self.node_timeout_s * self.visibility_fraction


def seconds(v: float) -> str:
    return f"{v * 1000:.1f} ms" if abs(v) < 1 else f"{v:.2f} s"


def problem(check: str, ranks: Iterable[int], detail: str, fix: str) -> dict:
    return {"check": check, "ranks": sorted({int(r) for r in ranks}), "detail": detail, "fix": fix}


# -- helpers ---------------------------------------------------------------------------------


def _norm(facts_by_rank: Mapping[Any, dict]) -> dict[int, dict]:
    return {int(r): f for r, f in sorted(facts_by_rank.items(), key=lambda kv: int(kv[0]))}


def who(facts: Mapping[int, dict], r: int) -> str:
    host = (facts.get(r) or {}).get("host")
    return f"rank {r} ({host})" if host else f"rank {r}"


def _whos(facts: Mapping[int, dict], ranks: Iterable[int]) -> str:
    return ", ".join(who(facts, r) for r in sorted(ranks))


def split_majority(values: Mapping[int, Any]) -> tuple[Any, list[int], list[tuple[Any, list[int]]]]:
    """(reference value, its ranks, [(other value, its ranks), ...]).

    The reference is the most common value; a tie goes to the group of the lowest rank.
    ``values`` must not be empty."""
    groups: dict[str, tuple[Any, list[int]]] = {}
    for r in sorted(values):
        key = repr(values[r])
        groups.setdefault(key, (values[r], []))[1].append(r)
    ordered = sorted(groups.values(), key=lambda g: (-len(g[1]), min(g[1])))
    ref_value, ref_ranks = ordered[0]
    return ref_value, ref_ranks, list(ordered[1:])


def _show(value: Any, missing: str = "not installed") -> str:
    return missing if value is None else str(value)


def _differs(facts: Mapping[int, dict], values: Mapping[int, Any], *, missing: str) -> tuple[list[int], str] | None:
    """Deviating ranks and a detail naming every group, or None when all agree (or no rank
    reported the fact: nothing to compare)."""
    if not values:
        return None
    ref, ref_ranks, others = split_majority(values)
    if not others:
        return None
    bad = [r for _, rs in others for r in rs]
    parts = [f"{_show(v, missing)} on {_whos(facts, rs)}" for v, rs in others]
    parts.append(f"{_show(ref, missing)} on {_whos(facts, ref_ranks)}")
    return bad, "; ".join(parts)


# -- versions and environment ----------------------------------------------------------------

VERSION_FIX = {
    "python": "Run every node from one environment (the same container image or a venv on the shared filesystem) so the Python versions match.",
    "driver": "Install the same NVIDIA driver on every node (nvidia-smi shows its version; a driver change needs the node drained and rebooted), or leave the odd node out of the job.",
    "orchestrator_source": "Every node must run the same orchestrator code: check out the same commit on each node (git rev-parse HEAD), or run it from one checkout on the shared filesystem.",
}


def _version_fix(name: str, ref: Any) -> str:
    if name in VERSION_FIX:
        return VERSION_FIX[name]
    want = f"pip install '{name}=={ref}'" if ref is not None else f"pip uninstall {name}"
    return (f"Install the same {name} on every node ({want} on the ranks named, or better, one container image or shared "
            f"venv for all nodes); mixed versions break collectives and weight loading in ways that look like hangs.")


def check_versions(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    names: list[str] = []
    for f in facts.values():
        for k in (f.get("versions") or {}):
            if k not in names:
                names.append(k)
    out = []
    for name in names:
        values = {r: (f.get("versions") or {}).get(name) for r, f in facts.items()}
        found = _differs(facts, values, missing="not installed" if name != "driver" else "no driver/nvidia-smi")
        if found:
            ref, _, _ = split_majority(values)
            bad, detail = found
            out.append(problem("versions", bad, f"{name}: {detail}", _version_fix(name, ref)))
    return out


def check_env(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    keys = sorted({k for f in facts.values() for k in (f.get("env") or {})})
    out = []
    for key in keys:
        values = {r: (f.get("env") or {}).get(key) for r, f in facts.items()}
        found = _differs(facts, values, missing="unset")
        if found:
            bad, detail = found
            out.append(problem(
                "env", bad, f"{key} differs: {detail}",
                f"Export the same {key} on every node (in scripts/run.sh or the job script that starts each rank); "
                f"NCCL/Gloo settings that differ between ranks make the process group hang at init or pick different transports."))
    return out


def check_cuda_visible_devices(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    values = {r: ("set" if f.get("cuda_visible_devices") is not None else "unset") for r, f in facts.items()}
    found = _differs(facts, values, missing="unset")
    if not found:
        return []
    bad, _ = found
    shown = "; ".join(f"{who(facts, r)}: {f.get('cuda_visible_devices')!r}" for r, f in facts.items()
                      if f.get("cuda_visible_devices") is not None)
    return [problem("cuda_visible_devices", bad, f"CUDA_VISIBLE_DEVICES is set on some ranks only ({shown}; unset elsewhere)",
                    "Set CUDA_VISIBLE_DEVICES on every node or on none: each node reports the GPUs it sees, and the "
                    "placement counts on every node exposing the GPUs you mean it to.")]


# -- interfaces --------------------------------------------------------------------------------


def parse_ifname_spec(spec: str, *, nccl: bool = True) -> tuple[bool, bool, list[str]]:
    """(exclude, exact, names) of an NCCL_SOCKET_IFNAME-style spec.

    NCCL: a comma list of name prefixes; ``^`` in front excludes them instead; ``=`` in front
    (after any ``^``) asks for exact names; ``name:port`` ignores the port. Gloo
    (``nccl=False``): a comma list of exact names."""
    s = spec.strip()
    exclude = exact = False
    if nccl and s.startswith("^"):
        exclude, s = True, s[1:]
    if nccl and s.startswith("="):
        exact, s = True, s[1:]
    if not nccl:
        exact = True
    names = [item.strip().split(":")[0] for item in s.split(",") if item.strip()]
    return exclude, exact, [n for n in names if n]


def ifname_matches(spec: str, interfaces: Mapping[str, dict], *, nccl: bool = True) -> list[str]:
    """The interfaces of one node a spec selects (any state), sorted."""
    exclude, exact, names = parse_ifname_spec(spec, nccl=nccl)

    def hit(name: str) -> bool:
        return name in names if exact else any(name.startswith(n) for n in names)

    if exclude:
        return sorted(n for n, i in interfaces.items() if not hit(n) and not i.get("loopback"))
    return sorted(n for n in interfaces if hit(n))


IFNAME_VARS = (("NCCL_SOCKET_IFNAME", True), ("GLOO_SOCKET_IFNAME", False))


def _usable(info: dict) -> bool:
    return bool(info.get("up")) and bool(info.get("addrs"))


def check_socket_ifname(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    groups: dict[tuple[str, str, str], list[int]] = {}
    details: dict[tuple[str, str, str], list[str]] = {}
    for r, f in facts.items():
        env = f.get("env") or {}
        ifaces = f.get("interfaces") or {}
        for var, nccl in IFNAME_VARS:
            spec = env.get(var)
            if spec is None:
                continue
            matched = ifname_matches(spec, ifaces, nccl=nccl)
            if not matched:
                kind = "missing"
                note = f"{who(facts, r)} has only {', '.join(sorted(ifaces)) or 'no interfaces'}"
            elif not any(ifaces[n].get("up") for n in matched):
                kind = "down"
                note = f"{who(facts, r)}: {', '.join(matched)} down"
            elif not any(_usable(ifaces[n]) for n in matched):
                kind = "no address"
                note = f"{who(facts, r)}: {', '.join(matched)} up but without an IP address"
            else:
                continue
            key = (var, spec, kind)
            groups.setdefault(key, []).append(r)
            details.setdefault(key, []).append(note)
    out = []
    for (var, spec, kind), ranks in groups.items():
        notes = "; ".join(details[(var, spec, kind)])
        if kind == "missing":
            detail = f"{var}={spec} names no interface that exists on {_whos(facts, ranks)} ({notes})"
            fix = (f"Set {var} to the data-plane interface every node has (`ip -br link` on each node lists them): "
                   f"NCCL takes name prefixes ('eth' matches eth0, eth1), '^docker,lo' to exclude, '=eth0' for an exact name; "
                   f"Gloo takes exact names. Or fix the interface naming on the nodes named.")
        elif kind == "down":
            detail = f"{var}={spec} selects only interfaces that are down ({notes})"
            fix = f"Bring the interface up on those nodes (ip link set dev IF up) or set {var} to an interface that is up."
        else:
            detail = f"{var}={spec} selects only interfaces without an address ({notes})"
            fix = f"Give the interface an address on those nodes, or set {var} to the interface that carries the nodes' IPs."
        out.append(problem("socket_ifname", ranks, detail, fix))
    return out


def _iface_holding(ifaces: Mapping[str, dict], address: str) -> str | None:
    for name, info in ifaces.items():
        if any(a.get("address") == address for a in info.get("addrs", [])):
            return name
    return None


def _subnet_match(ifaces: Mapping[str, dict], address: str) -> str | None:
    """The up, non-loopback interface of a node whose subnet holds ``address``."""
    try:
        target = ipaddress.ip_address(address)
    except ValueError:
        return None
    for name, info in sorted(ifaces.items()):
        if not info.get("up") or info.get("loopback"):
            continue
        for a in info.get("addrs", []):
            if not a.get("netmask"):
                continue
            try:
                net = ipaddress.ip_network(f"{a['address']}/{a['netmask']}", strict=False)
            except ValueError:
                continue
            if net.version == target.version and target in net and a["address"] != address:
                return name
    return None


def path_interfaces(facts: Mapping[int, dict]) -> dict[int, dict]:
    """Per rank, the interface it would use to talk to the master: ``{interface, mtu, how}``.

    The interface ``NCCL_SOCKET_IFNAME`` (else ``GLOO_SOCKET_IFNAME``) selects if set; else the
    device of the route to the master's address (``ip route get``, full doctor) or the
    interface whose subnet holds one of the master's addresses (quick); the master's own is the
    interface holding the address its workers reach. Ranks with no answer are left out."""
    facts = _norm(facts)
    master = facts.get(0) or {}
    master_ifaces = master.get("interfaces") or {}
    master_addrs = [d["address"] for d in reachable_addresses(master_ifaces)]
    paths: dict[int, dict] = {}
    used_master_addr: list[str] = []
    for r, f in facts.items():
        ifaces = f.get("interfaces") or {}
        env = f.get("env") or {}
        chosen = None
        for var, nccl in IFNAME_VARS:
            if env.get(var) is None:
                continue
            matched = [n for n in ifname_matches(env[var], ifaces, nccl=nccl) if _usable(ifaces[n]) and not ifaces[n].get("loopback")]
            if matched:
                route = f.get("route_to_master") or {}
                name = route.get("dev") if route.get("dev") in matched else matched[0]
                chosen = {"interface": name, "mtu": ifaces[name].get("mtu"), "how": f"{var}={env[var]}"}
            break  # the first variable set decides (NCCL's, else Gloo's); none matching is socket_ifname's problem
        else:
            if r == 0:
                continue  # decided below, from the address the workers reach
            route = f.get("route_to_master")
            if route and route.get("dev") in ifaces:
                mtu = ifaces[route["dev"]].get("mtu")
                if route.get("mtu"):
                    mtu = min(mtu, route["mtu"]) if mtu else route["mtu"]
                chosen = {"interface": route["dev"], "mtu": mtu, "how": f"route to {route.get('addr')}"}
                used_master_addr.append(route.get("addr"))
            else:
                for addr in master_addrs:
                    name = _subnet_match(ifaces, addr)
                    if name:
                        chosen = {"interface": name, "mtu": ifaces[name].get("mtu"), "how": f"subnet of {addr}"}
                        used_master_addr.append(addr)
                        break
        if chosen is not None:
            paths[r] = chosen
    if 0 in facts and 0 not in paths:
        addr = Counter(a for a in used_master_addr if a).most_common(1)
        address = addr[0][0] if addr else (master_addrs[0] if master_addrs else None)
        name = _iface_holding(master_ifaces, address) if address else None
        if name:
            paths[0] = {"interface": name, "mtu": master_ifaces[name].get("mtu"), "how": f"holds {address}"}
    return paths


def check_path_mtu(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    paths = path_interfaces(facts)
    values = {r: p["mtu"] for r, p in paths.items() if p.get("mtu")}
    if len(values) < 2:
        return []
    ref, ref_ranks, others = split_majority(values)
    if not others:
        return []
    bad = [r for _, rs in others for r in rs]

    def group(mtu: Any, ranks: list[int]) -> str:
        return ", ".join(f"{who(facts, r)} {paths[r]['interface']}" for r in ranks) + f": MTU {mtu}"

    detail = "MTU on the path between the nodes differs: " + "; ".join(
        [group(v, rs) for v, rs in others] + [group(ref, ref_ranks)])
    first_bad = bad[0]
    host = (facts.get(first_bad) or {}).get("host") or f"rank {first_bad}"
    fix = (f"Use one MTU end to end: on {host} `ip link set dev {paths[first_bad]['interface']} mtu {ref}` (and on the "
           f"bridge/switch port it hangs off), or raise every node and switch to the larger MTU if the fabric carries jumbo "
           f"frames. Check with `ping -M do -s <MTU-28> <peer>`: a mismatch passes small messages and hangs large collectives.")
    return [problem("path_mtu", bad, detail, fix)]


# -- GPUs, disk, fabric ------------------------------------------------------------------------


def check_gpu_count(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    values = {r: (f.get("gpus") or {}).get("count") for r, f in facts.items() if f.get("gpus") is not None}
    found = _differs(facts, values, missing="unknown")
    if not found:
        return []
    bad, detail = found
    return [problem("gpu_count", bad, f"GPU count differs: {detail.replace(' on ', ' GPU(s) on ')}",
                    "Nodes may differ (global GPU ranks count each node's own GPUs, docs/placement.md), but if these should "
                    "match, check `nvidia-smi -L` and CUDA_VISIBLE_DEVICES on the nodes named: a missing GPU (Xid error, fallen "
                    "off the bus) needs the node drained; a CUDA_VISIBLE_DEVICES left over from a shell hides GPUs.")]


def check_disk_space(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    low = {}
    for r, f in facts.items():
        lp = f.get("log_path") or {}
        free = lp.get("free_bytes")
        if free is not None and free < th.min_free_bytes:
            low[r] = lp
    if not low:
        return []
    shown = "; ".join(f"{who(facts, r)}: {lp['free_bytes'] / GIB:.1f} GiB free on {lp.get('mountpoint') or lp.get('path')}"
                      for r, lp in low.items())
    return [problem("disk_space", low, f"little free space on the log path ({shown}; want >= {th.min_free_bytes / GIB:.0f} GiB)",
                    "Free space on the shared filesystem (old iterations/, checkpoints/ of finished runs) or point --log-path "
                    "at a larger one: shards, aggregates and checkpoints are all written there, and a full disk fails the run.")]


def check_fabric_manager(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    bad, notes = [], []
    for r, f in facts.items():
        fm = f.get("fabric_manager")
        if not fm or not fm.get("expected") or fm.get("error"):
            continue
        if fm.get("active_state") != "active":
            bad.append(r)
            state = fm.get("active_state") if fm.get("load_state") == "loaded" else f"not installed ({fm.get('load_state')})"
            notes.append(f"{who(facts, r)}: {state} with {fm.get('nvswitches', 0)} NVSwitch device(s)")
    if not bad:
        return []
    return [problem("fabric_manager", bad, "nvidia-fabricmanager is not running on an NVSwitch node (" + "; ".join(notes) + ")",
                    "On those nodes: `systemctl restart nvidia-fabricmanager` (its version must match the driver's), then "
                    "`systemctl status nvidia-fabricmanager`; if it will not start, leave the node out: NCCL init hangs on "
                    "every node while one node's NVSwitch fabric is down.")]


def check_duplicate_hosts(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    by_host: dict[str, list[int]] = {}
    for r, f in facts.items():
        if f.get("host"):
            by_host.setdefault(f["host"], []).append(r)
    out = []
    for host, ranks in by_host.items():
        if len(ranks) > 1:
            out.append(problem("duplicate_host", ranks[1:], f"ranks {', '.join(map(str, ranks))} all report host {host}",
                               "Run one rank per node (check --master/--worker R or RANK on each node); if these are "
                               "different machines or containers with one hostname, set ORCHESTRATOR_HOST to a unique name on each."))
    return out


def check_num_nodes(facts: Mapping[int, dict], th: Thresholds) -> list[dict]:
    want = (facts.get(0) or {}).get("num_nodes")
    bad = [r for r, f in facts.items() if want is not None and f.get("num_nodes") not in (None, want)]
    if not bad:
        return []
    return [problem("num_nodes", bad, f"--num-nodes differs from the master's {want}: "
                    + "; ".join(f"{who(facts, r)} says {facts[r].get('num_nodes')}" for r in bad),
                    "Pass the same --num-nodes on every node.")]


# -- measurements between nodes ----------------------------------------------------------------


def _fs_fix(facts: Mapping[int, dict], th: Thresholds) -> str:
    mounts = sorted({f"{lp.get('fstype')} ({lp.get('options')})" for f in facts.values()
                     for lp in [f.get("log_path") or {}] if lp.get("fstype")})
    now = f" The log path is mounted as {'; '.join(mounts)}." if mounts else ""
    return ("Shorten the shared filesystem's caches on every node: NFS `-o actimeo=1` or `lookupcache=positive` "
            "(`noac` works but is slow), sshfs `-o cache=no` (or `cache_timeout=1`), blobfuse2 `--attr-cache-timeout=1 "
            "--attr-timeout=1 --entry-timeout=1 --negative-timeout=0`; or raise coordination.node_timeout_s well above the "
            f"latency measured (it is {th.node_timeout_s:g} s).{now}")


def check_filesystem(facts: Mapping[int, dict], fs: Mapping | None, th: Thresholds) -> list[dict]:
    if not fs:
        return []
    per = {int(r): m for r, m in (fs.get("per_rank") or {}).items()}
    out = []
    for key, what in (("new_file_s", "a new file"), ("replaced_file_s", "a replaced file's new content")):
        slow, unseen = [], []
        for r, m in per.items():
            if r == 0:
                continue
            v = m.get(key)
            if v is None:
                unseen.append(r)
            elif v >= th.max_visibility_s:
                slow.append(r)
        if unseen:
            out.append(problem("fs_visibility", unseen,
                               f"{_whos(facts, unseen)} did not see {what} from the master within {fs.get('timeout_s')} s",
                               _fs_fix(facts, th)))
        if slow:
            shown = ", ".join(f"{who(facts, r)} {seconds(per[r][key])}" for r in slow)
            out.append(problem("fs_visibility", slow,
                               f"{what} took long to become visible: {shown} (over {th.visibility_fraction:.0%} of the "
                               f"{th.node_timeout_s:g} s node timeout)", _fs_fix(facts, th)))
    skewed = []
    for r, m in per.items():
        skew, unc = m.get("clock_skew_s"), m.get("clock_uncertainty_s") or 0.0
        if skew is not None and abs(skew) - unc > th.max_clock_skew_s:
            skewed.append(r)
    if skewed:
        shown = ", ".join(f"{who(facts, r)} {per[r]['clock_skew_s']:+.2f} s (±{per[r].get('clock_uncertainty_s') or 0:.2f})"
                          for r in skewed)
        out.append(problem("clock_skew", skewed, f"clock differs from the master's by more than {th.max_clock_skew_s:g} s: {shown}",
                           "Synchronise the clocks (chrony or ntpd; `chronyc tracking` or `timedatectl` shows the state). The "
                           "orchestrator never compares clocks between nodes to decide anything, but logs, events and reports "
                           "line up only with synchronised clocks."))
    return out


# -- entry points ------------------------------------------------------------------------------

Check = Callable[[Mapping[int, dict], Thresholds], list]

ALL_CHECKS: tuple[Check, ...] = (
    check_num_nodes,
    check_versions,
    check_env,
    check_socket_ifname,
    check_path_mtu,
    check_cuda_visible_devices,
    check_gpu_count,
    check_fabric_manager,
    check_disk_space,
    check_duplicate_hosts,
)
# At run start: cheap, from facts already in the join records. Not duplicate_host (`orchestrator
# local` runs every rank on one host on purpose), not num_nodes (the config fingerprint covers it).
QUICK_CHECKS: tuple[Check, ...] = (
    check_versions,
    check_env,
    check_socket_ifname,
    check_path_mtu,
    check_cuda_visible_devices,
    check_gpu_count,
    check_fabric_manager,
    check_disk_space,
)


def run_checks(facts_by_rank: Mapping[Any, dict], filesystem: Mapping | None = None,
               thresholds: Thresholds = Thresholds(), checks: Iterable[Check] = ALL_CHECKS) -> list[dict]:
    facts = _norm(facts_by_rank)
    out: list[dict] = []
    for check in checks:
        out.extend(check(facts, thresholds))
    if filesystem is not None:
        out.extend(check_filesystem(facts, filesystem, thresholds))
    return out


def quick_problems(facts_by_rank: Mapping[Any, dict], thresholds: Thresholds = Thresholds()) -> list[dict]:
    """The subset for the start of a run: ``facts_by_rank`` maps rank -> ``facts.collect(quick=True)``."""
    return run_checks(facts_by_rank, None, thresholds, QUICK_CHECKS)


def describe(p: dict) -> str:
    """One log line for a problem."""
    return f"doctor: {p['check']} (ranks {', '.join(map(str, p['ranks']))}): {p['detail']}. Fix: {p['fix']}"
