//! The error type of the kernels crate.

/// Errors of the kernels: bad input names the argument, the value and what is accepted; a
/// backend failure says which backend and why. On error nothing in the pool has changed,
/// except for [`KernelError::Device`] after a launch started.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// An argument that does not fit the batch, the pool or the other arguments.
    #[error("invalid argument {arg}: {msg}")]
    InvalidArgument {
        /// The argument's name.
        arg: &'static str,
        /// What is wrong and what is accepted.
        msg: String,
    },
    /// The operation is not available on this backend (yet). (Every backend of this crate has
    /// every operation today; callers such as the CLI's accuracy table still handle it.)
    #[error("{backend} backend: {op} is not supported yet")]
    Unsupported {
        /// Backend name.
        backend: &'static str,
        /// Operation name.
        op: &'static str,
    },
    /// The backend cannot be used here (no driver, no GPU, compile failure).
    #[error("{backend} backend unavailable: {reason}")]
    Unavailable {
        /// Backend name.
        backend: &'static str,
        /// Why.
        reason: String,
    },
    /// A device call failed.
    #[error("{backend} device error: {msg}")]
    Device {
        /// Backend name.
        backend: &'static str,
        /// The failing call and its message.
        msg: String,
    },
    /// An error of the pool.
    #[error(transparent)]
    Pool(#[from] state_pool::PoolError),
}

/// Result alias of the kernels crate.
pub type Result<T, E = KernelError> = std::result::Result<T, E>;

impl KernelError {
    /// Shorthand for [`KernelError::InvalidArgument`].
    pub fn arg(arg: &'static str, msg: impl Into<String>) -> Self {
        Self::InvalidArgument {
            arg,
            msg: msg.into(),
        }
    }
}
