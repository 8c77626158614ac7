"""Engine integrations. Each subpackage imports its engine; ``kvtier`` alone does not."""
