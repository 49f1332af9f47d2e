//! A real Kubernetes control plane for tests: etcd and kube-apiserver on
//! loopback with TLS, a static admin token and RBAC, stopped (and its data
//! removed) when dropped or, for the shared instance, when the test binary
//! exits.
//!
//! Binaries come from `e2e/scripts/build-tools.sh` (`$WEFT_TOOLS_DIR`, default
//! `~/.cache/weft/tools/bin`).

pub mod kube_util;
pub mod operator;
pub mod pki;
pub mod process;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

pub use kube_util::{install_crds, new_namespace, unique_name, wait_for, wait_until_crds_take_creates};

/// Directory holding `kube-apiserver`, `etcd` and `kubectl`.
pub fn tools_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("WEFT_TOOLS_DIR") {
        return dir.into();
    }
    let cache = std::env::var_os("WEFT_TOOLS_CACHE")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/weft/tools")))
        .unwrap_or_else(|| PathBuf::from("/root/.cache/weft/tools"));
    cache.join("bin")
}

/// True when the binaries the control plane needs are present.
pub fn tools_present() -> bool {
    let dir = tools_dir();
    ["kube-apiserver", "etcd"].iter().all(|b| dir.join(b).is_file())
}

/// How the admin user authenticates.
const ADMIN_TOKEN_USER: &str = "weft-admin";

/// Where and how to run the control plane. The default (tests) runs both
/// processes in this network namespace on free loopback ports in a temp dir.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Run etcd and kube-apiserver inside this network namespace (the
    /// sandbox), with fixed ports; clients here reach it via `client_server`.
    pub netns: Option<String>,
    /// The apiserver's address in that namespace (bound and advertised).
    pub address: Option<std::net::Ipv4Addr>,
    /// The URL clients in this process's namespace use (e.g. a forwarder).
    pub client_server: Option<String>,
    /// Keep data here instead of a temp dir (removed on shutdown either way).
    pub dir: Option<PathBuf>,
    /// Client certificates to issue with the PKI (kubelets, kube-proxy).
    pub clients: Vec<pki::ClientIdentity>,
    /// The issued client certificate (a stem of `clients`) the apiserver
    /// presents to kubelets.
    pub kubelet_client: Option<String>,
    /// Authorize kubelets with the Node authorizer (and NodeRestriction)
    /// before RBAC, as clusters with real nodes do.
    pub node_authorization: bool,
    /// Flags appended to kube-apiserver's (a later flag overrides an earlier one).
    pub extra_apiserver_args: Vec<String>,
    /// More names and addresses the apiserver's certificate holds (an IPv6
    /// address and Service IP, say).
    pub extra_sans: Vec<String>,
}

/// A running etcd + kube-apiserver pair.
pub struct ControlPlane {
    /// `https://127.0.0.1:<port>`
    pub server: String,
    /// Bearer token of a `system:masters` user.
    pub token: String,
    /// Kubeconfig for the admin user.
    pub kubeconfig: PathBuf,
    /// `https://<address>:<port>` as seen inside the control plane's namespace.
    in_ns_server: String,
    /// CA certificate of the apiserver.
    pub ca_cert: PathBuf,
    /// Everything the PKI issued (client certificates, service-account keys).
    pub pki: pki::Pki,
    inner: Mutex<Running>,
}

struct Running {
    apiserver: Option<Child>,
    etcd: Option<Child>,
    /// How each was started, to start it again.
    etcd_command: Option<Started>,
    apiserver_command: Option<Started>,
    dir: Option<tempfile::TempDir>,
}

/// A process's program, arguments and log.
#[derive(Clone)]
struct Started(std::ffi::OsString, Vec<std::ffi::OsString>, PathBuf);

impl Started {
    fn of(command: &Command, log: &Path) -> Self {
        Self(command.get_program().to_owned(), command.get_args().map(ToOwned::to_owned).collect(), log.to_owned())
    }

    /// Starts it again, logging to a log of its own (the first run's stays
    /// as it was).
    fn spawn_again(&self) -> anyhow::Result<Child> {
        let mut command = Command::new(&self.0);
        command.args(&self.1);
        process::spawn_tied(command, &self.2.with_extension("restarted.log"))
    }
}

/// A control plane process a fault test restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Component {
    Etcd,
    Apiserver,
}

impl Component {
    pub fn name(self) -> &'static str {
        match self {
            Self::Etcd => "etcd",
            Self::Apiserver => "kube-apiserver",
        }
    }
}

impl ControlPlane {
    /// The control plane shared by all tests of this test binary, started on
    /// first use. Returns `None` (after a loud notice) when the binaries are
    /// missing outside CI; panics in CI or when the start fails.
    pub fn shared() -> Option<&'static ControlPlane> {
        static SHARED: OnceLock<Result<ControlPlane, String>> = OnceLock::new();
        let what = format!(
            "kube-apiserver and etcd in {} (build them with e2e/scripts/build-tools.sh)",
            tools_dir().display()
        );
        if !crate::prereq::require(&what, tools_present()) {
            return None;
        }
        let cp = SHARED.get_or_init(|| {
            let started = ControlPlane::start().map_err(|e| format!("{e:#}"));
            if started.is_ok() {
                // Statics are never dropped: stop the shared instance when
                // the test binary exits (libtest leaves via exit(3)).
                extern "C" fn stop_shared() {
                    if let Some(Ok(cp)) = SHARED.get() {
                        cp.shutdown();
                    }
                }
                // SAFETY: registering a plain extern "C" fn with no captures.
                unsafe { libc::atexit(stop_shared) };
            }
            started
        });
        match cp {
            Ok(cp) => Some(cp),
            Err(e) => panic!("starting the shared control plane failed: {e}"),
        }
    }

    /// Starts a fresh control plane (retried once if a port got taken).
    pub fn start() -> anyhow::Result<ControlPlane> {
        match Self::start_with(&Options::default()) {
            Ok(cp) => Ok(cp),
            Err(first) => {
                eprintln!("control plane start failed, retrying once: {first:#}");
                Self::start_with(&Options::default())
            }
        }
    }

    /// The in-namespace URL of the apiserver (what other namespaces use).
    pub fn in_namespace_server(&self) -> &str {
        &self.in_ns_server
    }

    /// A kubeconfig with [`Self::in_namespace_server`], for processes in
    /// the sandbox's namespaces.
    pub fn in_namespace_kubeconfig(&self) -> PathBuf {
        self.kubeconfig.with_file_name("kubeconfig-in-cluster")
    }

    pub fn start_with(opts: &Options) -> anyhow::Result<ControlPlane> {
        let tools = tools_dir();
        let dir = match &opts.dir {
            Some(d) => {
                std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
                tempfile::Builder::new().prefix("cp-").tempdir_in(d).context("creating control plane dir")?
            }
            None => tempfile::Builder::new().prefix("weft-cp-").tempdir().context("creating control plane dir")?,
        };
        let root = dir.path().to_path_buf();
        let address = opts.address.unwrap_or(std::net::Ipv4Addr::LOCALHOST);
        let sans: Vec<String> = std::iter::once(address.to_string()).chain(opts.extra_sans.iter().cloned()).collect();
        let pki = pki::generate_with_sans(&root, &sans, &opts.clients)?;

        // Inside a namespace of our own every port is free.
        let (etcd_client, etcd_peer, api_port) = match opts.netns {
            Some(_) => (2379, 2380, 6443),
            None => (free_port()?, free_port()?, free_port()?),
        };
        let in_ns = |program: PathBuf| -> Command {
            match &opts.netns {
                Some(ns) => process::in_netns(ns, program),
                None => Command::new(program),
            }
        };
        let token = format!("weft-{:032x}", rand::random::<u128>());
        let token_file = root.join("tokens.csv");
        std::fs::write(&token_file, format!("{token},{ADMIN_TOKEN_USER},weft-admin-uid,\"system:masters\"\n"))
            .context("writing token file")?;

        let mut running =
            Running { apiserver: None, etcd: None, etcd_command: None, apiserver_command: None, dir: Some(dir) };

        let mut etcd = in_ns(tools.join("etcd"));
        etcd.args([
            "--name=weft-test",
            &format!("--data-dir={}", root.join("etcd").display()),
            &format!("--listen-client-urls=http://127.0.0.1:{etcd_client}"),
            &format!("--advertise-client-urls=http://127.0.0.1:{etcd_client}"),
            &format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"),
            &format!("--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"),
            &format!("--initial-cluster=weft-test=http://127.0.0.1:{etcd_peer}"),
            "--listen-metrics-urls=",
            // Test data is throwaway: skip fsync to keep the suite fast.
            "--unsafe-no-fsync",
            "--log-level=warn",
        ]);
        let etcd_log = root.join("etcd.log");
        running.etcd_command = Some(Started::of(&etcd, &etcd_log));
        running.etcd = Some(process::spawn_tied(etcd, &etcd_log)?);

        let mut apiserver = in_ns(tools.join("kube-apiserver"));
        apiserver.args([
            &format!("--etcd-servers=http://127.0.0.1:{etcd_client}"),
            &format!(
                "--bind-address={}",
                if opts.netns.is_some() { "0.0.0.0".to_owned() } else { address.to_string() }
            ),
            &format!("--advertise-address={address}"),
            &format!("--secure-port={api_port}"),
            &format!("--cert-dir={}", root.join("certs").display()),
            &format!("--tls-cert-file={}", pki.serving_cert.display()),
            &format!("--tls-private-key-file={}", pki.serving_key.display()),
            &format!("--client-ca-file={}", pki.ca_cert.display()),
            &format!("--token-auth-file={}", token_file.display()),
            &format!("--authorization-mode={}", if opts.node_authorization { "Node,RBAC" } else { "RBAC" }),
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            &format!("--service-account-key-file={}", pki.service_account_pub.display()),
            &format!("--service-account-signing-key-file={}", pki.service_account_key.display()),
            "--service-cluster-ip-range=10.96.0.0/16",
            // The aggregation layer (flows.weft.dev): the apiserver proxies
            // to extension apiservers with the front proxy's client
            // certificate and passes the user in these headers.
            &format!("--requestheader-client-ca-file={}", pki.front_proxy_ca_cert.display()),
            &format!("--requestheader-allowed-names={}", pki::FRONT_PROXY_CLIENT_CN),
            "--requestheader-username-headers=X-Remote-User",
            "--requestheader-group-headers=X-Remote-Group",
            "--requestheader-extra-headers-prefix=X-Remote-Extra-",
            &format!("--proxy-client-cert-file={}", pki.front_proxy_client_cert.display()),
            &format!("--proxy-client-key-file={}", pki.front_proxy_client_key.display()),
            // No kube-proxy in the apiserver's namespace: dial the
            // endpoints' addresses, not the Service's cluster IP.
            "--enable-aggregator-routing=true",
            "--allow-privileged=true",
            "--enable-priority-and-fairness=false",
            "--profiling=false",
            "--v=1",
        ]);
        if let Some(stem) = &opts.kubelet_client {
            let cert = pki.clients.iter().find(|c| &c.stem == stem).context("kubelet client certificate not issued")?;
            apiserver.arg(format!("--kubelet-client-certificate={}", cert.cert.display()));
            apiserver.arg(format!("--kubelet-client-key={}", cert.key.display()));
        }
        if opts.node_authorization {
            apiserver.arg("--enable-admission-plugins=NodeRestriction");
        }
        apiserver.args(&opts.extra_apiserver_args);
        let api_log = root.join("kube-apiserver.log");
        running.apiserver_command = Some(Started::of(&apiserver, &api_log));
        running.apiserver = Some(process::spawn_tied(apiserver, &api_log)?);

        let in_ns_server = format!("https://{address}:{api_port}");
        let server = opts.client_server.clone().unwrap_or_else(|| in_ns_server.clone());
        let kubeconfig = root.join("kubeconfig");
        std::fs::write(&kubeconfig, kubeconfig_yaml(&server, &pki.ca_cert, &token)).context("writing kubeconfig")?;
        // For clients inside the sandbox's namespaces (agents, operator).
        std::fs::write(root.join("kubeconfig-in-cluster"), kubeconfig_yaml(&in_ns_server, &pki.ca_cert, &token))
            .context("writing in-namespace kubeconfig")?;

        let cp = ControlPlane {
            server,
            in_ns_server,
            token,
            kubeconfig,
            ca_cert: pki.ca_cert.clone(),
            pki: pki.clone(),
            inner: Mutex::new(running),
        };
        if let Err(e) = cp.wait_ready(Duration::from_secs(90)) {
            let detail = format!(
                "{e:#}\n--- etcd.log (tail) ---\n{}\n--- kube-apiserver.log (tail) ---\n{}",
                process::log_tail(&etcd_log, 2000),
                process::log_tail(&api_log, 4000)
            );
            cp.shutdown();
            bail!("control plane did not become ready: {detail}");
        }
        Ok(cp)
    }

    /// Polls `/readyz` until it answers `ok` or the deadline passes; fails
    /// early when a process exits.
    fn wait_ready(&self, timeout: Duration) -> anyhow::Result<()> {
        let kubeconfig = self.kubeconfig.clone();
        let deadline = Instant::now() + timeout;
        // A private runtime on its own thread: callers may or may not be
        // inside a tokio runtime, and clients must not outlive their runtime.
        let mut last_err = String::from("no answer yet");
        while Instant::now() < deadline {
            self.check_alive()?;
            let kc = kubeconfig.clone();
            let probe = std::thread::spawn(move || -> anyhow::Result<String> {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                rt.block_on(async move {
                    let client = kube_util::client_from(&kc).await?;
                    let req = http::Request::get("/readyz").body(Vec::new())?;
                    let body = tokio::time::timeout(Duration::from_secs(5), client.request_text(req))
                        .await
                        .context("readyz timed out")??;
                    Ok(body)
                })
            })
            .join()
            .map_err(|_| anyhow::anyhow!("readyz probe panicked"))?;
            match probe {
                Ok(body) if body.trim() == "ok" => return Ok(()),
                Ok(body) => last_err = body,
                Err(e) => last_err = format!("{e:#}"),
            }
            std::thread::sleep(Duration::from_millis(250));
        }
        bail!("/readyz not ok after {timeout:?}: {last_err}")
    }

    fn check_alive(&self) -> anyhow::Result<()> {
        let mut guard = self.inner.lock().map_err(|_| anyhow::anyhow!("control plane lock poisoned"))?;
        let running = &mut *guard;
        for (name, child) in [("etcd", &mut running.etcd), ("kube-apiserver", &mut running.apiserver)] {
            if let Some(child) = child
                && let Ok(Some(status)) = child.try_wait()
            {
                bail!("{name} exited early: {status}");
            }
        }
        Ok(())
    }

    /// Kills `which` (SIGKILL, as a crash) and starts it again (etcd on the
    /// same data), then waits until the apiserver is ready again.
    pub fn restart(&self, which: Component) -> anyhow::Result<()> {
        {
            let mut guard = self.inner.lock().map_err(|_| anyhow::anyhow!("control plane lock poisoned"))?;
            let running = &mut *guard;
            let (child, command) = match which {
                Component::Etcd => (&mut running.etcd, &running.etcd_command),
                Component::Apiserver => (&mut running.apiserver, &running.apiserver_command),
            };
            if let Some(mut old) = child.take() {
                let _ = old.kill();
                let _ = old.wait();
            }
            let command = command.clone().with_context(|| format!("{} was not started here", which.name()))?;
            *child = Some(command.spawn_again()?);
        }
        self.wait_ready(Duration::from_secs(60))
    }

    /// Process id of one of them while it runs.
    pub fn pid(&self, which: Component) -> Option<u32> {
        let running = self.inner.lock().ok()?;
        match which {
            Component::Etcd => running.etcd.as_ref(),
            Component::Apiserver => running.apiserver.as_ref(),
        }
        .map(Child::id)
    }

    /// Writes the apiserver's pid to `path` (for pausing the API in tests).
    pub fn write_apiserver_pid(&self, path: &Path) -> anyhow::Result<()> {
        let pid = self.pid(Component::Apiserver).context("the apiserver is not running")?;
        std::fs::write(path, pid.to_string()).with_context(|| format!("writing {}", path.display()))
    }

    /// Process ids of etcd and kube-apiserver while they run.
    pub fn pids(&self) -> Vec<u32> {
        let Ok(running) = self.inner.lock() else { return Vec::new() };
        running.etcd.iter().chain(running.apiserver.iter()).map(Child::id).collect()
    }

    /// The directory holding etcd's data, certificates and logs.
    pub fn data_dir(&self) -> Option<PathBuf> {
        self.inner.lock().ok()?.dir.as_ref().map(|d| d.path().to_path_buf())
    }

    /// A new client for the admin user, bound to the caller's runtime.
    pub async fn client(&self) -> anyhow::Result<kube::Client> {
        kube_util::client_from(&self.kubeconfig).await
    }

    /// Stops both processes and removes the data directory. Idempotent.
    pub fn shutdown(&self) {
        let Ok(mut running) = self.inner.lock() else { return };
        if let Some(mut api) = running.apiserver.take() {
            process::stop(&mut api, Duration::from_secs(5));
        }
        if let Some(mut etcd) = running.etcd.take() {
            process::stop(&mut etcd, Duration::from_secs(5));
        }
        if let Some(dir) = running.dir.take() {
            if std::env::var_os("WEFT_KEEP_CONTROL_PLANE").is_some() {
                eprintln!("keeping control plane dir {}", dir.keep().display());
            } else {
                let _ = dir.close();
            }
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A loopback port that was free a moment ago.
pub fn free_port() -> anyhow::Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").context("binding a free port")?;
    Ok(listener.local_addr()?.port())
}

fn kubeconfig_yaml(server: &str, ca: &Path, token: &str) -> String {
    format!(
        "apiVersion: v1
kind: Config
clusters:
- name: weft-test
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: {ADMIN_TOKEN_USER}
  user:
    token: {token}
contexts:
- name: weft-test
  context:
    cluster: weft-test
    user: {ADMIN_TOKEN_USER}
current-context: weft-test
",
        ca = ca.display()
    )
}
