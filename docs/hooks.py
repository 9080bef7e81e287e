"""mkdocs hooks: the site's home page is the README (its links into docs/ made relative to the site), and the config
reference is generated from the typed config (ray_jobs/config/reference.py) -- both on every build, never a copy."""

from __future__ import annotations

from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]


def on_files(files, config):
    from ray_jobs.config import Config
    from ray_jobs.config.reference import markdown

    home = (ROOT / "README.md").read_text().replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=home))
    files.append(File.generated(config, "reference/config.md", content=markdown(Config)))
    return files
