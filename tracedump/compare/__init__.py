"""The comparator: load two dumps, align, unshard, measure, name the first divergence."""
