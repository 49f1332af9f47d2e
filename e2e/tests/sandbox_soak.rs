//! The soak: 1,000 pod ADDs and DELs through weft-cni on one sandbox node
//! while the node's agent is SIGKILLed and the operator's leader is SIGKILLed
//! at random moments, the apiserver is paused for a stretch, and etcd and
//! then the apiserver are killed and restarted. Each failed
//! ADD is followed by DEL, as a runtime does; DEL is retried until it
//! succeeds. At the end nothing may be left: no address, host port, veth,
//! rule or object, and no two live pods ever shared an address. The figures
//! are printed as a table.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rand::Rng;
use serde_json::{Value, json};
use weft_e2e::cni::{self, Container, Outcome, Weft};
use weft_e2e::netns::Netns;
use weft_e2e::sandbox::testing::{Up, ok, run};
use weft_e2e::sandbox::{State, state_dir};
use weft_e2e::supervisor::StateFile;
use weft_e2e::wait;

const OPS: usize = 1000;
const SLOTS: usize = 8;
/// Ops during which the apiserver is paused (each ADD then waits for the
/// API's 5 s timeout before answering "try again later").
const PAUSED: std::ops::Range<usize> = 400..410;
/// Before these ops etcd, then the apiserver, is killed and started again.
const ETCD_RESTART: usize = 700;
const APISERVER_RESTART: usize = 850;

#[derive(Default)]
struct Tally {
    adds_ok: usize,
    adds_failed: BTreeMap<u64, usize>,
    /// Each distinct failure message (cut short), with its code and count.
    failures: BTreeMap<(u64, String), usize>,
    dels: usize,
    del_retries: usize,
}

/// DEL, repeated until it succeeds (the agent may be restarting).
fn del_until_ok(weft: &Weft, c: &Container, prev: Option<&Value>, tally: &mut Tally) {
    wait::until(&format!("DEL of {}", c.id), Duration::from_secs(90), || {
        let out = weft.del(c, prev);
        if !out.success {
            tally.del_retries += 1;
        }
        out.success.then_some(())
    });
    tally.dels += 1;
}

fn with_port<'a>(weft: &Weft<'a>, slot: usize) -> Weft<'a> {
    let mut conf = weft.conf.clone();
    conf["runtimeConfig"] =
        json!({"portMappings": [{"hostPort": 21000 + slot, "containerPort": 80, "protocol": "tcp"}]});
    Weft { node: weft.node, conf, plugin: weft.plugin.clone() }
}

#[test]
fn a_thousand_adds_and_dels_with_agents_and_leaders_killed_leave_nothing() {
    let Some(_up) = Up::start(&["--nodes", "1", "--agent-arg=--resync-seconds=2"], &[]) else { return };
    let state = State::load().expect("sandbox state");
    let node = state.node("node-1").expect("node-1");
    let node_ns = Netns::existing(&node.netns);
    let weft = Weft::new(&node_ns, &node.socket);
    let subnet_uid = ok(&["kubectl", "get", "subnet", "node-1", "-o", "jsonpath={.metadata.uid}"]);
    let pods: Vec<Netns> = (0..SLOTS).map(|i| Netns::new(&format!("soak{i}"))).collect();

    // Faults at random moments, from another thread, while the ops run. The
    // lock is held while one is injected, so the main thread can hold them
    // off (an agent restarted while the API is paused could not start).
    let done = Arc::new(AtomicBool::new(false));
    let hold = Arc::new(Mutex::new(false));
    let (agent_kills, leader_kills) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let faults = {
        let (done, hold) = (done.clone(), hold.clone());
        let (agent_kills, leader_kills) = (agent_kills.clone(), leader_kills.clone());
        std::thread::spawn(move || {
            let mut rng = rand::rng();
            while !done.load(Ordering::SeqCst) {
                // The gap between faults is the fault schedule, not a wait for anything.
                std::thread::sleep(Duration::from_millis(rng.random_range(500..2500)));
                let held = hold.lock().unwrap_or_else(|p| p.into_inner());
                if done.load(Ordering::SeqCst) || *held {
                    continue;
                }
                if rng.random_bool(0.7) {
                    ok(&["restart-agent", "node-1", "--kill"]);
                    agent_kills.fetch_add(1, Ordering::SeqCst);
                } else if run(&["restart-leader", "--kill"]).0 {
                    leader_kills.fetch_add(1, Ordering::SeqCst);
                }
            }
        })
    };

    let started = Instant::now();
    let mut rng = rand::rng();
    let mut tally = Tally::default();
    let mut live: Vec<Option<(Container, Value, String)>> = (0..SLOTS).map(|_| None).collect();
    let mut paused = false;
    for op in 0..OPS {
        if op == PAUSED.start {
            *hold.lock().unwrap_or_else(|p| p.into_inner()) = true;
            wait::until("the agent up before the API pause", Duration::from_secs(60), || {
                weft.status().success.then_some(())
            });
            ok(&["api-pause"]);
            paused = true;
        }
        if op == PAUSED.end {
            ok(&["api-resume"]);
            paused = false;
            *hold.lock().unwrap_or_else(|p| p.into_inner()) = false;
        }
        if let Some(command) = match op {
            ETCD_RESTART => Some("etcd-restart"),
            APISERVER_RESTART => Some("apiserver-restart"),
            _ => None,
        } {
            // While the API is down the agent could not start: no agent kills now.
            let held = hold.lock().unwrap_or_else(|p| p.into_inner());
            wait::until(&format!("the agent up before {command}"), Duration::from_secs(60), || {
                weft.status().success.then_some(())
            });
            ok(&[command]);
            drop(held);
        }
        let slot = rng.random_range(0..SLOTS);
        let weft_slot = with_port(&weft, slot);
        match live[slot].take() {
            Some((c, result, _)) => del_until_ok(&weft_slot, &c, Some(&result), &mut tally),
            None => {
                let c = Container::new(format!("soak-{slot}-{op}"), &pods[slot]);
                let out: Outcome = weft_slot.add(&c);
                if out.success {
                    let result = out.json();
                    let ip = cni::pod_ip(&result);
                    let holder = live.iter().flatten().find(|(_, _, other)| *other == ip);
                    assert!(holder.is_none(), "{ip} given to {} while {:?} holds it", c.id, holder.map(|h| &h.0.id));
                    tally.adds_ok += 1;
                    live[slot] = Some((c, result, ip));
                } else {
                    let code = out.json()["code"].as_u64().unwrap_or(0);
                    *tally.adds_failed.entry(code).or_default() += 1;
                    let msg: String = out.msg().chars().take(160).collect();
                    *tally.failures.entry((code, msg)).or_default() += 1;
                    del_until_ok(&weft_slot, &c, None, &mut tally);
                }
            }
        }
    }
    if paused {
        ok(&["api-resume"]);
    }
    done.store(true, Ordering::SeqCst);
    faults.join().expect("fault thread");
    for (slot, entry) in live.iter_mut().enumerate() {
        if let Some((c, result, _)) = entry.take() {
            del_until_ok(&with_port(&weft, slot), &c, Some(&result), &mut tally);
        }
    }
    let elapsed = started.elapsed();

    // Nothing left, without any GC: records, veths, rules, objects.
    let ipam = state_dir().join("node-1").join("state").join("ipam");
    let records = || {
        std::fs::read_dir(&ipam)
            .map(|d| d.flatten().filter(|e| !e.file_name().to_string_lossy().starts_with('.')).count())
            .unwrap_or(usize::MAX)
    };
    let veths = || node_ns.ip(&["-o", "link", "show"]).lines().filter(|l| l.contains("weftv")).count();
    let rules = || {
        let out = node_ns.exec("nft", &["list", "table", "inet", "weft"]);
        String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.contains("dnat ip to")).count()
    };
    let allocations = || {
        let out = ok(&["kubectl", "get", "hostportallocations", "-A", "-o", "json"]);
        serde_json::from_str::<Value>(&out).ok().and_then(|v| v["items"].as_array().map(Vec::len))
    };
    wait::until("the agent serving again", Duration::from_secs(60), || weft.status().success.then_some(()));
    wait::until("the node's HostPortAllocations gone", Duration::from_secs(60), || {
        (allocations() == Some(0)).then_some(())
    });
    let subnets = ok(&["kubectl", "get", "subnets", "-o", "jsonpath={range .items[*]}{.metadata.uid}{\"\\n\"}{end}"]);
    let (adds_failed, dels, del_retries) = (tally.adds_failed.values().sum::<usize>(), tally.dels, tally.del_retries);

    eprintln!();
    eprintln!("| soak (1 node, {OPS} ops, {SLOTS} pod slots with a host port each) | value |");
    eprintln!("|---|---:|");
    eprintln!("| elapsed | {:.1} s |", elapsed.as_secs_f64());
    eprintln!("| ADD ok | {} |", tally.adds_ok);
    eprintln!("| ADD failed (then DEL), by CNI code | {adds_failed} {:?} |", tally.adds_failed);
    for ((code, msg), n) in &tally.failures {
        eprintln!("| … {n} × code {code} | {} |", msg.replace('|', "/"));
    }
    eprintln!("| DEL ok | {dels} (after {del_retries} failed tries while the agent was down) |");
    eprintln!("| agent SIGKILLs | {} |", agent_kills.load(Ordering::SeqCst));
    eprintln!("| operator leader SIGKILLs | {} |", leader_kills.load(Ordering::SeqCst));
    eprintln!("| apiserver paused | ops {}..{} |", PAUSED.start, PAUSED.end);
    eprintln!("| etcd killed and restarted | before op {ETCD_RESTART} |");
    eprintln!("| apiserver killed and restarted | before op {APISERVER_RESTART} |");
    eprintln!("| left: IPAM records | {} |", records());
    eprintln!("| left: weft veths | {} |", veths());
    eprintln!("| left: host port rules | {} |", rules());
    eprintln!("| left: HostPortAllocations | {:?} |", allocations());
    eprintln!("| Subnets | {} |", subnets.lines().count());
    assert!(agent_kills.load(Ordering::SeqCst) >= 5, "too few agent kills for a soak");
    assert!(tally.adds_ok >= OPS / 4, "too few ADDs succeeded: {}", tally.adds_ok);
    // An agent restarting or an API outage is "try again later", never an
    // internal error.
    assert!(tally.adds_failed.keys().all(|code| *code == 11), "ADD failures other than 11: {:?}", tally.failures);
    assert_eq!((records(), veths(), rules()), (0, 0, 0), "addresses, veths or host port rules leaked");
    assert_eq!(subnets.trim(), subnet_uid.trim(), "the node's lease changed or was duplicated");
}
