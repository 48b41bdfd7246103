//! The Kubernetes client of a command: kubectl's `--kubeconfig` and `--context`, else
//! `$KUBECONFIG`, `~/.kube/config` or the pod's in-cluster credentials.

use std::path::PathBuf;

use anyhow::Context;
use kube::config::{KubeConfigOptions, Kubeconfig};

use ipreclaim::request_deadline::{REQUEST_DEADLINE, with_deadline};

/// `--kubeconfig` and `--context`, for commands a person runs (flatten into their args).
#[derive(Debug, Clone, Default, clap::Args)]
pub struct KubeArgs {
    /// Path to the kubeconfig file (default: $KUBECONFIG, else ~/.kube/config, else the pod's
    /// in-cluster credentials).
    #[arg(long, value_name = "PATH")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (default: its current context).
    #[arg(long, value_name = "NAME")]
    pub context: Option<String>,
}

impl KubeArgs {
    /// The client configuration these flags select.
    pub async fn config(&self) -> anyhow::Result<kube::Config> {
        let options = KubeConfigOptions {
            context: self.context.clone(),
            ..Default::default()
        };
        match (&self.kubeconfig, &self.context) {
            (Some(path), _) => {
                let file = Kubeconfig::read_from(path)
                    .with_context(|| format!("read kubeconfig {}", path.display()))?;
                kube::Config::from_custom_kubeconfig(file, &options)
                    .await
                    .with_context(|| format!("use kubeconfig {}", path.display()))
            }
            (None, Some(context)) => kube::Config::from_kubeconfig(&options)
                .await
                .with_context(|| format!("use context {context:?} of the kubeconfig")),
            (None, None) => kube::Config::infer()
                .await
                .context("no Kubernetes client config (set KUBECONFIG, or run in a pod)"),
        }
    }

    /// A client with [`config`](Self::config); `retry`: kube's own retry of failed requests.
    /// Each request that is not a watch has [`REQUEST_DEADLINE`].
    pub async fn client(&self, retry: bool) -> anyhow::Result<kube::Client> {
        let mut config = self.config().await?;
        if !retry {
            config.default_retry = false;
        }
        let client = kube::Client::try_from(config).context("building the Kubernetes client")?;
        Ok(with_deadline(client, REQUEST_DEADLINE))
    }
}
