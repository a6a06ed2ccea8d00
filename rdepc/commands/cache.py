"""``rdepc cache info`` and ``rdepc cache clear``: the compilation cache (``rdepc.runtime.cache``)."""

from __future__ import annotations


def cmd_cache_info(args) -> int:
    from rdepc.runtime import cache

    i = cache.info()
    print(f"compilation cache {i.directory} ({i.chosen_by})")
    if not i.exists:
        print("  entries         0 (the directory does not exist yet)")
        return 0
    print(f"  entries         {i.entries}, {cache.human_size(i.size)}")
    if not i.damaged:
        print(f"  verification    {'every entry verifies' if i.entries else 'nothing to verify'}")
    else:
        print(f"  verification    {len(i.damaged)} of {i.entries} fail (rebuilt on their next use):")
        for path, problem in i.damaged:
            print(f"    {path}: {problem}")
    if i.tuning_records:
        print(f"  tuning records  {i.tuning_records} (rdepc tune; cache clear keeps them)")
    return 0


def cmd_cache_clear(args) -> int:
    from rdepc.runtime import cache

    removed, freed = cache.clear()
    what = "entry" if removed == 1 else "entries"
    print(f"removed {removed} {what} from {cache.cache_dir()}, freed {cache.human_size(freed)}")
    return 0
