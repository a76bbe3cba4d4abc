//! The packet model's acceleration switches, one set of flags for every command that can
//! run the packet model (`netsim`, and `predict` and `emulate` with `--network packet`), so
//! each mechanism can be turned off, and the memo cache kept in a file, wherever the
//! accelerated model answers.

use anyhow::Context;
use orrery_net::packet::{MemoCache, PacketConfig, PacketSimulator};
use std::path::PathBuf;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct PacketFlags {
    /// Packet model: turn off steady-state fast-forwarding (on by default; same as
    /// `[packet] accel.fast_forward = false`).
    #[arg(long)]
    no_fast_forward: bool,
    /// Packet model: fast-forward the whole network as one partition instead of each
    /// group of flows joined by shared links on its own (`accel.partitioning = false`).
    #[arg(long)]
    no_partitioning: bool,
    /// Packet model: jump a partition only after the whole steadiness window, even where
    /// nothing queues and no flow has a rate cut pending (`accel.quiet_window = 0`).
    #[arg(long)]
    no_quiet_jumps: bool,
    /// Packet model: never jump a partition while DCQCN is cutting its flows' rates, even
    /// where they are cut at a steady cadence and the cuts do not change what the flows
    /// deliver yet (`accel.cut_jumps = false`).
    #[arg(long)]
    no_cut_jumps: bool,
    /// Packet model: turn off memoization of repeated isolated episodes
    /// (`accel.memoize = false`).
    #[arg(long)]
    no_memo: bool,
    /// Packet model: simulate every isomorphic group started at the same instant instead
    /// of one per kind, the others mirroring it (`accel.mirror = false`).
    #[arg(long)]
    no_mirror: bool,
    /// Packet model: simulate every step of collectives whose chains have settled into a
    /// periodic regime instead of extrapolating them (`accel.periodic = false`).
    #[arg(long)]
    no_periodic: bool,
    /// Packet model: simulate every collective that repeats an earlier one of the same
    /// shape instead of finishing its flows at the earlier one's times
    /// (`accel.collective_memo = false`).
    #[arg(long)]
    no_collective_memo: bool,
    /// Packet model: simulate every host of traffic that repeats itself host by host
    /// instead of one copy per orbit (`accel.symmetry = false`).
    #[arg(long)]
    no_symmetry: bool,
    /// Packet model: find only symmetries that map every flow, none that leave flows of one
    /// packet out of the check (`accel.symmetry_exempt = false`).
    #[arg(long)]
    strict_symmetry: bool,
    /// Packet model: the packet-by-packet reference, every acceleration off.
    #[arg(long)]
    reference: bool,
    /// Packet model: schedule every port's free, even one that will find nothing to send
    /// (`lazy_port_frees = false`; the same results with more events; see the field's docs).
    #[arg(long)]
    eager_port_frees: bool,
    /// Packet model: load memoized episodes and kept collectives from this file if it
    /// exists (a corrupt or foreign file is reported and ignored) and save the cache back
    /// to it afterwards.
    #[arg(long, value_name = "FILE")]
    memo_cache: Option<PathBuf>,
}

impl PacketFlags {
    /// Turns off in `config` what the flags turn off (a flag never turns anything on).
    pub fn apply(&self, config: &mut PacketConfig) {
        config.lazy_port_frees &= !self.eager_port_frees;
        let off = self.reference;
        let a = &mut config.accel;
        a.fast_forward &= !(self.no_fast_forward || off);
        a.partitioning &= !(self.no_partitioning || off);
        // With fast-forwarding off (`--reference`) no partition jumps, quiet, cut or
        // other: these two only narrow which jumps it takes.
        a.cut_jumps &= !self.no_cut_jumps;
        if self.no_quiet_jumps {
            a.quiet_window = 0;
        }
        a.memoize &= !(self.no_memo || off);
        a.mirror &= !(self.no_mirror || off);
        a.periodic &= !(self.no_periodic || off);
        a.collective_memo &= !(self.no_collective_memo || off);
        a.symmetry &= !(self.no_symmetry || off);
        a.symmetry_exempt &= !(self.strict_symmetry || off);
    }

    /// The default packet model with the flags applied.
    pub fn config(&self) -> PacketConfig {
        let mut config = PacketConfig::default();
        self.apply(&mut config);
        config
    }

    /// A simulator with the default packet model and the flags applied (see
    /// [`PacketFlags::simulator_with`]).
    pub fn simulator(&self) -> PacketSimulator {
        self.simulator_with(self.config())
    }

    /// A simulator with `config`, whose memo cache starts from the `--memo-cache` file when
    /// one is named and exists. A file that does not load (corrupt, truncated, written by
    /// another version) is reported on stderr and ignored, never trusted: the run starts
    /// with an empty cache, as without the flag, and [`PacketFlags::save_cache`] replaces
    /// the file.
    pub fn simulator_with(&self, config: PacketConfig) -> PacketSimulator {
        let cache = match &self.memo_cache {
            Some(path) if path.exists() => MemoCache::load(path).unwrap_or_else(|e| {
                eprintln!("warning: ignoring memo cache {}: {e}", path.display());
                MemoCache::new()
            }),
            _ => MemoCache::new(),
        };
        PacketSimulator::with_cache(config, cache)
    }

    /// Writes `sim`'s memo cache to the `--memo-cache` file (atomically, see
    /// [`MemoCache::save`]); nothing without the flag. Call it after a run that succeeded,
    /// so the file keeps what every run of the command learned.
    pub fn save_cache(&self, sim: &PacketSimulator) -> anyhow::Result<()> {
        match &self.memo_cache {
            Some(path) => sim
                .cache()
                .save(path)
                .with_context(|| format!("saving the memo cache to {}", path.display())),
            None => Ok(()),
        }
    }

    /// The flags given, as typed, so a command whose network is not the packet model can
    /// refuse them by name.
    pub fn given(&self) -> Vec<&'static str> {
        [
            (self.no_fast_forward, "--no-fast-forward"),
            (self.no_partitioning, "--no-partitioning"),
            (self.no_quiet_jumps, "--no-quiet-jumps"),
            (self.no_cut_jumps, "--no-cut-jumps"),
            (self.no_memo, "--no-memo"),
            (self.no_mirror, "--no-mirror"),
            (self.no_periodic, "--no-periodic"),
            (self.no_collective_memo, "--no-collective-memo"),
            (self.no_symmetry, "--no-symmetry"),
            (self.strict_symmetry, "--strict-symmetry"),
            (self.reference, "--reference"),
            (self.eager_port_frees, "--eager-port-frees"),
            (self.memo_cache.is_some(), "--memo-cache"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect()
    }

    /// Checks the memo cache's folder before any work (see [`crate::InputProblems::output`]).
    pub fn check_outputs(&self, problems: &mut crate::InputProblems) {
        problems.output("--memo-cache", self.memo_cache.as_deref());
    }

    /// An error for flags given to a command running another network model than the
    /// packet one (`network`, as the user chose it), or `None` if none was given.
    pub fn refuse_unless_packet(&self, network: &str) -> Option<anyhow::Error> {
        if network == "packet" {
            return None;
        }
        self.refuse_without_packet(
            &[],
            &format!("the network model is {network}"),
            "add --network packet",
        )
    }

    /// An error naming the switches given, with `also` (the command's own flags that only
    /// the packet model reads), to a run without the packet model: `why` says what it runs
    /// instead, `fix` how to run the packet model. `None` if none was given.
    pub fn refuse_without_packet(
        &self,
        also: &[&'static str],
        why: &str,
        fix: &str,
    ) -> Option<anyhow::Error> {
        let mut given = self.given();
        given.extend_from_slice(also);
        let one = given.len() == 1;
        (!given.is_empty()).then(|| {
            crate::bad(format!(
                "{} {} to the packet model, but {why}: {fix} or leave {} out",
                given.join(", "),
                if one { "applies" } else { "apply" },
                if one { "it" } else { "them" }
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_is_the_packet_by_packet_reference() {
        let flags = PacketFlags {
            reference: true,
            ..PacketFlags::default()
        };
        assert_eq!(flags.config(), PacketConfig::reference());
    }

    #[test]
    fn each_flag_turns_off_its_own_mechanism_only() {
        let on = PacketConfig::default();
        let flags = PacketFlags {
            no_memo: true,
            ..PacketFlags::default()
        };
        let c = flags.config();
        assert!(!c.accel.memoize);
        let mut back = c.clone();
        back.accel.memoize = true;
        assert_eq!(back, on);
        let quiet = PacketFlags {
            no_quiet_jumps: true,
            ..PacketFlags::default()
        }
        .config();
        assert_eq!(quiet.accel.quiet_window, 0);
        assert!(quiet.accel.fast_forward && quiet.accel.partitioning);
        let mut repeats = PacketFlags {
            no_collective_memo: true,
            ..PacketFlags::default()
        }
        .config();
        assert!(!repeats.accel.collective_memo && repeats.accel.periodic);
        repeats.accel.collective_memo = true;
        assert_eq!(repeats, on);
        assert_eq!(PacketFlags::default().config(), on);
    }

    #[test]
    fn flags_are_refused_by_name_off_the_packet_model() {
        let flags = PacketFlags {
            no_memo: true,
            no_symmetry: true,
            ..PacketFlags::default()
        };
        let e = flags.refuse_unless_packet("flow").unwrap().to_string();
        assert!(e.contains("--no-memo, --no-symmetry"), "{e}");
        assert!(e.contains("network model is flow"), "{e}");
        assert!(flags.refuse_unless_packet("packet").is_none());
        assert!(PacketFlags::default()
            .refuse_unless_packet("analytical")
            .is_none());
    }
}
