"""What every stored record shares: unknown fields refused, assignments validated, a schema version, migration of
older files on read, and a JSON form that keeps exactly the fields that were set (a field never set is not written,
so files stay as small and as readable as the dicts they replace) -- and, for a whole record, its schema version."""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError

from ray_jobs.storage import read_json


class RecordError(ValueError):
    """A stored record that does not fit its schema (a field unknown to this version, a value of the wrong type)."""


class Part(BaseModel):
    """A piece of a record (an attempt, an incident): strict about its fields like the record itself."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    def set(self, **fields: Any) -> Self:
        """Set several fields at once (each validated); returns self."""
        for name, value in fields.items():
            setattr(self, name, value)
        return self

    def unset(self, name: str) -> None:
        """Back to the field's default, and not written (as a key popped from a dict)."""
        setattr(self, name, type(self).model_fields[name].get_default(call_default_factory=True))
        self.__pydantic_fields_set__.discard(name)

    def dump(self) -> dict[str, Any]:
        """The JSON-ready form: the fields that were set, nothing else."""
        return self.model_dump(mode="json", exclude_unset=True)


class Record(Part):
    """A whole stored file. ``SCHEMA`` is the version this code writes; ``migrate`` lifts an older tree to it."""

    SCHEMA: ClassVar[int] = 1
    schema_version: int = 1

    def dump(self, full: bool = False) -> dict[str, Any]:
        """The JSON-ready form, always with this code's schema version first: a record made here (not read) has its
        version unset, and a file written without one would be read as version 1 once a second version exists.
        ``full``: every field, set or not (a file a person reads whole, e.g. each trial's state from the start)."""
        tree = self.model_dump(mode="json") if full else super().dump()
        tree.pop("schema_version", None)
        return {"schema_version": self.SCHEMA, **tree}

    @classmethod
    def migrate(cls, tree: dict[str, Any]) -> dict[str, Any]:
        """An older version's tree in this version's shape (subclasses add steps as versions come)."""
        return tree

    @classmethod
    def read(cls, url: str) -> Self | None:
        """The record stored at ``url`` (parsed as :meth:`parse` does), or None when there is no such file."""
        try:
            tree = read_json(url)
        except FileNotFoundError:
            return None
        except ValueError as e:  # torn by a host crash, hand-edited: named, never a traceback
            raise RecordError(f"{url}: not a JSON record ({e})") from None
        if not isinstance(tree, dict):
            raise RecordError(f"{url}: not a record (a JSON {type(tree).__name__}, not an object)")
        return cls.parse(tree, url)

    @classmethod
    def parse(cls, tree: dict[str, Any], where: str) -> Self:
        """The record from a stored tree, migrated first; RecordError naming ``where`` and each bad field."""
        tree = cls.migrate(dict(tree))
        version = tree.get("schema_version", 1)
        if type(version) is not int:  # a garbled or hand-edited file: refused like any bad field, never a TypeError
            raise RecordError(f"{where}: schema_version: not a version number ({version!r})")
        if version > cls.SCHEMA:
            raise RecordError(
                f"{where}: schema_version {tree['schema_version']} is newer than this unbroken "
                f"reads ({cls.SCHEMA}); upgrade unbroken"
            )
        try:
            record = cls.model_validate(tree)
        except ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc']))}: {err['msg']}" for err in e.errors())
            raise RecordError(f"{where}: {problems}") from None
        record.schema_version = cls.SCHEMA
        return record
