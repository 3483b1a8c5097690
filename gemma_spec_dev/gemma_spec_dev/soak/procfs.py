"""What /proc says about the server process: the soak's resource samples."""
from __future__ import annotations

import os
from typing import Dict


def proc_sample(pid: int) -> Dict[str, float]:
    """RSS (total, anonymous, file-backed; MiB), threads and open files of process ``pid`` from
    /proc; an empty dict when the process is gone."""
    keys = {"VmRSS:": "rss_mib", "RssAnon:": "rss_anon_mib", "RssFile:": "rss_file_mib",
            "Threads:": "threads"}
    values: Dict[str, float] = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                name = line.split(None, 1)[0] if line.strip() else ""
                if name in keys:
                    number = int(line.split()[1])
                    values[keys[name]] = number if name == "Threads:" else number / 1024
        values["open_files"] = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return {}
    return values
