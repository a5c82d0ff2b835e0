//! Which kernels each operation launches, by name, for profiler-based tooling: DeepEP's (and the
//! tools built on it) find an operation's kernel in a profile by a name substring, and expect
//! exactly one kernel of an operation to contain `dispatch` (or `combine`), any other one
//! `notify`. [`OPERATIONS`] is that contract; the test below holds it against the `.cu` sources.

/// (operation, the word its kernel's name contains, the kernels one call launches in order).
/// Hook mode launches the same low-latency kernel twice (send, then the hook's receive).
pub const OPERATIONS: &[(&str, &str, &[&str])] = &[
    ("get_dispatch_layout", "dispatch", &["ep_dispatch_layout"]),
    (
        "intranode dispatch",
        "dispatch",
        &["ep_intranode_notify", "ep_intranode_dispatch"],
    ),
    (
        "intranode combine",
        "combine",
        &["ep_intranode_notify_barrier", "ep_intranode_combine_pull"],
    ),
    ("low-latency dispatch", "dispatch", &["ep_ll_dispatch"]),
    ("low-latency combine", "combine", &["ep_ll_combine"]),
    (
        "low-latency dispatch (transport)",
        "dispatch",
        &["ep_ll_dispatch_net"],
    ),
    (
        "low-latency combine (transport)",
        "combine",
        &["ep_ll_combine_net"],
    ),
];

#[cfg(test)]
mod tests {
    use super::OPERATIONS;

    const SOURCES: &[&str] = &[
        include_str!("../cuda/intranode.cu"),
        include_str!("../cuda/layout.cu"),
        include_str!("../cuda/low_latency.cu"),
    ];

    fn defined(name: &str) -> bool {
        SOURCES.iter().any(|s| {
            s.lines()
                .any(|l| l.contains("__global__") && l.contains(&format!(" {name}(")))
        })
    }

    #[test]
    fn each_operation_shows_one_kernel_of_its_name_and_notify_kernels() {
        for (op, word, kernels) in OPERATIONS {
            let named: Vec<_> = kernels.iter().filter(|k| k.contains(word)).collect();
            assert_eq!(
                named.len(),
                1,
                "{op}: kernels {kernels:?}, one must contain {word:?}"
            );
            for k in *kernels {
                assert!(defined(k), "{op}: no kernel {k} in the .cu sources");
                let other = if *word == "dispatch" {
                    "combine"
                } else {
                    "dispatch"
                };
                assert!(!k.contains(other), "{op}: {k} contains {other:?}");
                if !k.contains(word) {
                    assert!(
                        k.contains("notify"),
                        "{op}: {k} is neither the {word} kernel nor a notify kernel"
                    );
                }
            }
        }
    }
}
